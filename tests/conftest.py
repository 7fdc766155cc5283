import os
import sys

# Rank processes import test modules by name; make this folder importable there too.
sys.path.insert(0, os.path.dirname(__file__))
