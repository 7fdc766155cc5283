// Every collective and point-to-point call of c10d's Backend, staged: each says what
// it copies in (StagedCall::in), what it writes back (out, inOut), and what it calls on
// the communicator; StagingBackend::stage does the rest.
#include <algorithm>

#include "staging.h"
#include "torch_releases.h"

namespace comm_native {
namespace {

Tensors flat(const TensorLists& lists) {
  Tensors all;
  for (const auto& list : lists) all.insert(all.end(), list.begin(), list.end());
  return all;
}

// `opts` with its reduce op as the copies `inputs` run it (see StagedCall::reduceOp).
template <typename Options>
Options reducing(StagedCall& call, Options opts, const Tensors& inputs) {
  opts.reduceOp = call.reduceOp(opts.reduceOp, inputs);
  return opts;
}

// An all-reduce of `copies`, the staged tensors it reduces in place.
WorkPtr allreduceCopies(StagedCall& call, Tensors copies, const c10d::AllreduceOptions& opts) {
  auto options = reducing(call, opts, copies);
  return call.communicator().allreduce(copies, options);
}

} // namespace

WorkPtr StagingBackend::broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) {
  auto send = [&](StagedCall& call, Tensors part) {
    // The source's tensors are only read: nothing comes back to them. The other ranks'
    // are only written, whole: buffers, with nothing copied in (as the fix by hand does).
    auto copies = getRank() == opts.rootRank ? call.inReported(part) : call.out(part);
    return call.communicator().broadcast(copies, opts);
  };
  if (auto work = stageOneInChunks("broadcast", c10d::OpType::BROADCAST, tensors, nullptr, send)) return work;
  return stage("broadcast", c10d::OpType::BROADCAST, [&](StagedCall& call) { return send(call, tensors); });
}

int64_t StagingBackend::chunkLength(const Tensors& tensors, int64_t deviceCopies) {
  if (chunkBytes_ <= 0 || tensors.empty()) return 0;
  for (const auto& tensor : tensors) {
    if (!tensor.device().is_cpu() || !tensor.is_contiguous()) return 0;
  }
  const auto& first = tensors.front();
  // Whole blocks of the device allocators' 512 bytes (CUDA's and torch_npu's caching
  // allocators round every block up to that), so that a chunk's buffers fill no more than it.
  auto block = std::max<int64_t>(1, 512 / first.element_size());
  auto chunk = chunkBytes_ / (deviceCopies * first.element_size());
  chunk = std::max<int64_t>(1, chunk >= block ? chunk - chunk % block : chunk);
  if (first.numel() < 2 * chunk) return 0;
  fixTarget();
  if (target().is_cpu() || block_.openHere()) return 0;
  return chunk;
}

std::vector<Span> spans(int64_t length, int64_t chunk) {
  std::vector<Span> all;
  for (int64_t start = 0; start < length; start += chunk) all.push_back(Span{start, std::min(chunk, length - start)});
  return all;
}

WorkPtr StagingBackend::stageChunks(const char* name, c10d::OpType type, const Tensors& results,
                                    const std::vector<Span>& chunks, const Reduction* reduction,
                                    const std::function<WorkPtr(StagedCall&, Span)>& run) {
  auto budget = this->budget();
  auto depth = budget > 0 ? std::max<size_t>(1, static_cast<size_t>(budget / chunkBytes_)) : chunks.size();
  makeRoom();
  std::vector<WorkPtr> works;
  std::vector<std::shared_ptr<WriteBack>> backs;
  std::optional<c10::Stream> waitOn;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (i >= depth) {
      c10::make_intrusive<StagedWork>(std::vector<WorkPtr>{works[i - depth]},
                                      std::vector<std::shared_ptr<WriteBack>>{backs[i - depth]}, type, waitOn)
          ->retire();
      works[i - depth].reset(); // the communicator's work may hold the chunk's copy
      backs[i - depth].reset();
    }
    auto issued = issue(name, [&](StagedCall& call) { return run(call, chunks[i]); }, reduction);
    works.push_back(issued.work);
    backs.push_back(issued.back);
    waitOn = issued.waitOn;
  }
  // The work of the chunks still in flight, which the caller waits for.
  auto first = chunks.size() > depth ? chunks.size() - depth : 0;
  auto work = c10::make_intrusive<StagedWork>(std::vector<WorkPtr>(works.begin() + first, works.end()),
                                              std::vector<std::shared_ptr<WriteBack>>(backs.begin() + first, backs.end()),
                                              type, waitOn, results);
  track(work);
  return work;
}

WorkPtr StagingBackend::stageOneInChunks(const char* name, c10d::OpType type, Tensors& tensors,
                                         const Reduction* reduction,
                                         const std::function<WorkPtr(StagedCall&, Tensors)>& run) {
  if (tensors.size() != 1) return WorkPtr(); // each tensor of a list is chunked alike or not at all
  auto chunk = chunkLength(tensors, 1);
  if (chunk == 0) return WorkPtr();
  auto flat = tensors.front().view(-1);
  return stageChunks(name, type, tensors, spans(flat.numel(), chunk), reduction,
                     [&](StagedCall& call, Span span) { return run(call, {span.of(flat)}); });
}

WorkPtr StagingBackend::allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  auto reduce = [&](StagedCall& call, Tensors part) { return allreduceCopies(call, call.inOut(part), opts); };
  Reduction reduction{"allreduce", tensors};
  if (auto work = stageOneInChunks("all_reduce", c10d::OpType::ALLREDUCE, tensors, &reduction, reduce)) return work;
  return stage("all_reduce", c10d::OpType::ALLREDUCE, [&](StagedCall& call) { return reduce(call, tensors); },
               &reduction);
}

WorkPtr StagingBackend::allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  Reduction reduction{"allreduce_coalesced", tensors};
  return stage("all_reduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, [&](StagedCall& call) {
    if (StagedCall::flattens(tensors)) { // one flat buffer: one transfer each way, one all-reduce
      return allreduceCopies(call, {call.flat(tensors, /*reads=*/true)}, opts);
    }
    auto copies = call.inOut(tensors);
    auto options = reducing(call, opts, copies);
    return call.communicator().allreduce_coalesced(copies, options);
  }, &reduction);
}

WorkPtr StagingBackend::reduce(Tensors& tensors, const c10d::ReduceOptions& opts) {
  auto reduceTo = [&](StagedCall& call, Tensors part) {
    // Only the destination's tensors are written.
    auto copies = getRank() == opts.rootRank ? call.inOut(part) : call.inReported(part);
    auto options = reducing(call, opts, copies);
    return call.communicator().reduce(copies, options);
  };
  Reduction reduction{"reduce", tensors};
  if (auto work = stageOneInChunks("reduce", c10d::OpType::REDUCE, tensors, &reduction, reduceTo)) return work;
  return stage("reduce", c10d::OpType::REDUCE, [&](StagedCall& call) { return reduceTo(call, tensors); }, &reduction);
}

WorkPtr StagingBackend::allgather(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  return stage("all_gather", c10d::OpType::ALLGATHER, [&](StagedCall& call) {
    auto in = call.in(inputs);
    auto out = call.out(outputs);
    return call.communicator().allgather(out, in, opts);
  });
}

WorkPtr StagingBackend::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  auto gather = [&](StagedCall& call, const at::Tensor& part, const at::Tensor& into) {
    auto in = call.in(part);
    auto out = call.out(into);
    return call.communicator()._allgather_base(out, in, opts);
  };
  // In chunks: chunk [a, b) of every rank's input lands in columns [a, b) of the output
  // seen as one row per rank; a chunk's input and its rows are on the device together.
  if (auto chunk = output.numel() == input.numel() * getSize() ? chunkLength({input, output}, getSize() + 1) : 0) {
    auto flat = input.view(-1);
    auto rows = output.view({getSize(), flat.numel()});
    return stageChunks("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, {output}, spans(flat.numel(), chunk),
                       nullptr, [&](StagedCall& call, Span span) {
                         return gather(call, span.of(flat), rows.narrow(1, span.start, span.length));
                       });
  }
  return stage("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE,
               [&](StagedCall& call) { return gather(call, input, output); });
}

WorkPtr StagingBackend::allgather_coalesced(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  // One flat gather, as torch's ProcessGroupNCCL runs it too: HCCL has no allgather_coalesced
  // (torch_npu's ProcessGroupHCCL does not override it), and every backend has _allgather_base.
  // Rank r's block of the flat output holds its inputs end to end, as outputs[r] lists them.
  auto outs = flat(outputs);
  for (const auto& tensor : outs) {
    TORCH_CHECK(tensor.scalar_type() == inputs.at(0).scalar_type(),
                "all_gather_coalesced needs one dtype for every tensor; got ", inputs.at(0).scalar_type(), " and ",
                tensor.scalar_type());
  }
  return stage("all_gather_coalesced", c10d::OpType::ALLGATHER_COALESCED, [&](StagedCall& call) {
    auto in = call.inFlat(inputs);
    auto out = call.flat(outs, /*reads=*/false);
    return call.communicator()._allgather_base(out, in, opts);
  });
}

WorkPtr StagingBackend::allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                        const c10d::AllgatherOptions& opts) {
  return stage("all_gather_into_tensor_coalesced", c10d::OpType::COALESCED, [&](StagedCall& call) {
    auto in = call.in(inputs);
    auto out = call.out(outputs);
    return call.communicator().allgather_into_tensor_coalesced(out, in, opts);
  });
}

WorkPtr StagingBackend::gather(TensorLists& outputs, Tensors& inputs, const c10d::GatherOptions& opts) {
  return stage("gather", c10d::OpType::GATHER, [&](StagedCall& call) {
    auto in = call.in(inputs);
    auto out = call.out(outputs); // empty except on the root
    try {
      return call.communicator().gather(out, in, opts);
    } catch (const std::exception& error) {
      // ProcessGroupHCCL has no gather and says so at the call, before anything is sent
      // (the torch-npu 2.13.0 wheel); torch_npu runs dist.gather of NPU tensors as an
      // all-gather (its torch_npu/distributed/distributed_c10d.py, _gather), and so does comm:
      // every rank receives every piece, the root's are written back.
      if (std::string(error.what()).find("ProcessGroupHCCL does not support gather") == std::string::npos) throw;
    }
    TensorLists everyone = out.empty() ? TensorLists{call.scratch(in, getSize())} : out;
    c10d::AllgatherOptions gathering;
    gathering.timeout = opts.timeout;
    return call.communicator().allgather(everyone, in, gathering);
  });
}

WorkPtr StagingBackend::scatter(Tensors& outputs, TensorLists& inputs, const c10d::ScatterOptions& opts) {
  return stage("scatter", c10d::OpType::SCATTER, [&](StagedCall& call) {
    auto in = call.in(inputs); // empty except on the root
    auto out = call.out(outputs);
    return call.communicator().scatter(out, in, opts);
  });
}

WorkPtr StagingBackend::reduce_scatter(Tensors& outputs, TensorLists& inputs, const c10d::ReduceScatterOptions& opts) {
  Reduction reduction{"reduce_scatter", outputs};
  return stage("reduce_scatter", c10d::OpType::REDUCE_SCATTER, [&](StagedCall& call) {
    auto in = call.in(inputs);
    auto out = call.out(outputs);
    auto options = reducing(call, opts, flat(in));
    return call.communicator().reduce_scatter(out, in, options);
  }, &reduction);
}

WorkPtr StagingBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                             const c10d::ReduceScatterOptions& opts) {
  auto scatter = [&](StagedCall& call, const at::Tensor& from, const at::Tensor& part) {
    auto in = call.in(from);
    auto out = call.out(part);
    auto options = reducing(call, opts, {in});
    return call.communicator()._reduce_scatter_base(out, in, options);
  };
  Reduction reduction{"_reduce_scatter_base", {output, input}};
  // In chunks: chunk [a, b) of the output reduces columns [a, b) of the input seen as one
  // row per rank; a chunk's rows and its output are on the device together.
  if (auto chunk = input.numel() == output.numel() * getSize() ? chunkLength({output, input}, getSize() + 1) : 0) {
    auto flat = output.view(-1);
    auto rows = input.view({getSize(), flat.numel()});
    return stageChunks("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                       spans(flat.numel(), chunk), &reduction, [&](StagedCall& call, Span span) {
                         return scatter(call, rows.narrow(1, span.start, span.length), span.of(flat));
                       });
  }
  return stage("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE,
               [&](StagedCall& call) { return scatter(call, input, output); }, &reduction);
}

WorkPtr StagingBackend::reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                        const c10d::ReduceScatterOptions& opts) {
  Reduction reduction{"reduce_scatter_tensor_coalesced", inputs};
  return stage("reduce_scatter_tensor_coalesced", comm_releases::kReduceScatterTensorCoalesced, [&](StagedCall& call) {
    auto in = call.in(inputs);
    auto out = call.out(outputs);
    auto options = reducing(call, opts, in);
    return call.communicator().reduce_scatter_tensor_coalesced(out, in, options);
  }, &reduction);
}

WorkPtr StagingBackend::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                      std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  return stage("all_to_all_single", c10d::OpType::ALLTOALL_BASE, [&](StagedCall& call) {
    auto in = call.in(input);
    auto out = call.out(output);
    return call.communicator().alltoall_base(out, in, output_splits, input_splits, opts);
  });
}

WorkPtr StagingBackend::alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) {
  return stage("all_to_all", c10d::OpType::ALLTOALL, [&](StagedCall& call) {
    auto in = call.in(inputs);
    auto out = call.out(outputs);
    return call.communicator().alltoall(out, in, opts);
  });
}

WorkPtr StagingBackend::send(Tensors& tensors, int dst, int tag) {
  return stage("send", c10d::OpType::SEND, [&](StagedCall& call) {
    auto in = call.in(tensors);
    return call.communicator().send(in, dst, tag);
  });
}

WorkPtr StagingBackend::recv(Tensors& tensors, int src, int tag) {
  return stage("recv", c10d::OpType::RECV, [&](StagedCall& call) {
    auto out = call.out(tensors);
    return call.communicator().recv(out, src, tag);
  });
}

WorkPtr StagingBackend::recvAnysource(Tensors& tensors, int tag) {
  return stage("recv", c10d::OpType::RECVANYSOURCE, [&](StagedCall& call) {
    // Of c10d's backends only gloo and mpi receive from any source; nccl refuses, so does
    // torch_npu's hccl ("ProcessGroupHCCL does not support recv", ProcessGroupHCCL.cpp:6988-6992).
    auto& comm = call.communicator();
    auto backend = comm.getBackendName();
    TORCH_CHECK(backend == "gloo" || backend == "mpi", "a receive from any source (src=None) cannot be staged onto ",
                target().str(), ": the group's backend there, ", backend,
                ", cannot receive from any source; name the sender");
    auto out = call.out(tensors);
    return comm.recvAnysource(out, tag);
  });
}

WorkPtr StagingBackend::barrier(const c10d::BarrierOptions& opts) {
  return stage("barrier", c10d::OpType::BARRIER, [&](StagedCall& call) { return call.communicator().barrier(opts); });
}

} // namespace comm_native
