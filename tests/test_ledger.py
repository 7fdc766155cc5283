"""comm's one ledger of replacements: modules, classes that only inherit, dicts; restored only where still comm's."""

import functools
import logging
import threading
import types

import pytest

from comm import _ledger


class Base:
    def method(self):
        return "base"


class Child(Base):  # only inherits method
    pass


def _module(**attributes):
    module = types.ModuleType("ledger_test_module")
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def test_replace_and_restore_a_module_attribute_a_dict_entry_and_an_inherited_method():
    module, table = _module(f=len), {"g": abs}
    assert _ledger.replace(module, "f", max, by="test") and _ledger.replace(table, "g", min, by="test")
    assert _ledger.replace(Child, "method", lambda self: "comm's", by="test")
    assert not _ledger.replace(module, "f", sum, by="test")  # held already: the first replacement stays
    assert (module.f, table["g"], Child().method()) == (max, min, "comm's")
    assert {(r.name, r.original) for r in _ledger.entries() if r.by == "test"} == {
        ("f", len), ("g", abs), ("method", Base.method)}
    _ledger.restore(by="test")
    assert module.f is len and table["g"] is abs and "method" not in vars(Child) and Child().method() == "base"
    assert _ledger.held("test") == frozenset()


def test_restore_leaves_what_someone_put_there_after_comm(caplog):
    module = _module(f=len)
    _ledger.replace(module, "f", max, by="test")
    module.f = sorted  # a plugin imported after comm
    with caplog.at_level(logging.DEBUG, logger="comm"):
        _ledger.restore(by="test")
    assert module.f is sorted and "ledger_test_module.f" in caplog.text


def test_restore_only_some_and_two_parts_of_comm_cannot_hold_one_attribute():
    module = _module(f=len, g=abs)
    _ledger.replace(module, "f", max, by="test")
    _ledger.replace(module, "g", min, by="test")
    with pytest.raises(RuntimeError, match="other cannot replace ledger_test_module.f: test holds it"):
        _ledger.replace(module, "f", sum, by="other")
    _ledger.restore(by="test", only={(id(module), "f")})
    assert module.f is len and module.g is min
    _ledger.restore(by="test")
    assert module.g is abs


def _around(inner, *args):
    return ("comm", inner(*args))


def test_follow_wraps_whatever_is_assigned_later_and_restore_puts_back_the_last_one():
    module = _module(helper=len)
    assert _ledger.follow(module, "helper", _around, by="test")
    assert module.helper([1]) == ("comm", 1) and type(module) is not types.ModuleType
    module.helper = lambda items: "theirs"  # a plugin's copy, put there after comm's
    assert module.helper([1]) == ("comm", "theirs")
    theirs = _ledger.entries()[-1].original
    _ledger.restore(by="test")
    assert module.helper is theirs and type(module) is types.ModuleType
    module.helper = len  # no longer followed
    assert module.helper is len
    with pytest.raises(TypeError, match="only a module's attributes"):
        _ledger.follow(Child, "method", _around, by="test")


def test_a_monkeypatch_round_trip_while_followed_leaves_one_stand_in_and_restore_leaves_none(monkeypatch):
    module = _module(helper=len)
    _ledger.follow(module, "helper", _around, by="test")
    stand_in = module.helper
    monkeypatch.setattr(module, "helper", sorted)
    assert module.helper([2, 1]) == ("comm", [1, 2])
    monkeypatch.undo()  # puts comm's own stand-in back: recognised, not wrapped again
    assert module.helper is stand_in and module.helper([1]) == ("comm", 1)
    _ledger.restore(by="test")
    assert module.helper is len and not _ledger.held("test")


def test_a_plugin_that_wraps_comms_stand_in_runs_comm_once_and_not_at_all_after_restore():
    module = _module(helper=len)
    _ledger.follow(module, "helper", _around, by="test")

    def plugin(function):  # wraps whatever it finds, as a plugin patching c10d would
        @functools.wraps(function)  # (copies the attributes of comm's stand-in onto its own)
        def wrapper(*args):
            return ("plugin", function(*args))
        return wrapper

    module.helper = plugin(module.helper)
    assert module.helper([1]) == ("comm", ("plugin", 1))  # comm's inner stand-in hands the call on
    _ledger.restore(by="test")
    assert module.helper([1]) == ("plugin", 1)  # the plugin's stays; comm inside it acts no more
    _ledger.follow(module, "helper", _around, by="test")  # patched again: in front of the plugin, once
    assert module.helper([1]) == ("comm", ("plugin", 1))
    _ledger.restore(by="test")


def test_threads_replacing_and_restoring_at_once_leave_the_originals():
    modules = [_module(f=len) for _ in range(4)]
    errors = []

    def worker():
        try:
            for step in range(200):
                for module in modules:
                    _ledger.replace(module, "f", max, by="threads")
                if step % 3 == 0:
                    _ledger.restore(by="threads")
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(module.f is max for module in modules)
    _ledger.restore(by="threads")
    assert errors == [] and all(module.f is len for module in modules)
