"""The mutants of the mutation pass (``python -m harness.mutation``): one broken promise each.

Each mutant replaces one snippet of a file under tessera/ (the snippet must occur there exactly once;
``tests/test_mutants_list.py`` checks that in CI, so the list follows the code) and names the fast tests
that must notice. They cover the code that carries the product's promises: the optimizer (loss-scale
removal, DP averaging, the global norm and clipping, overflow agreement, accumulation, ZeRO's
reduce-scatter and all-gather, the master policy, the skip rule), the loss scaler, the precision wrapper
and the backend switches, the vocab-parallel loss and its chunked fused form, and the tensor- and
sequence-parallel layers and collectives. ``EQUIVALENT`` lists changes that look like bugs but change
nothing a user could notice, each with the reason (``notice`` holds it there).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """One textual change: ``original`` (exactly once in ``path``) becomes ``replacement``."""

    name: str
    path: str  # relative to the repository root, under tessera/
    original: str
    replacement: str
    notice: str  # what a user would notice (for EQUIVALENT: why nothing)
    tests: tuple[str, ...]  # test files or node ids, relative to the root: the fast tests that must fail


OPT = "tessera/optim/"
LOSS_SCALE = "tests/test_loss_scale.py"
OPTIMIZER = "tests/test_optimizer.py"
ZERO_DP2 = "tests/test_optimizer_dist.py::test_zero1_equivalence_memory_and_resharded_resume"
OVERFLOW_DP2 = "tests/test_optimizer_dist.py::test_overflow_on_one_rank_skips_everywhere_with_hysteresis"
PROMISES_OPTIM = "tests/test_promises_optim.py"
PROMISES_PARALLEL = "tests/test_promises_parallel.py"
SCALER = "tests/test_grad_scaler.py"
AMP = "tests/test_naive_amp.py"
LAYERS = "tests/test_parallel_layers.py"
CHUNKED_FP64 = "tests/test_chunked_loss.py::test_equals_cross_entropy_on_the_full_logits_in_fp64"
PLAN_TESTS = "tests/test_precision_plan.py"
RECIPES_TESTS = "tests/test_published_recipes.py"
CHUNKED_TP2 = "tests/test_chunked_loss.py::test_vocab_parallel_matches_one_rank[2]"
MSP_TP2 = "tests/test_sequence_parallel.py::test_msp_matches_mtp_tp2"
WGRAD = "tests/test_wgrad_fusion.py"
FP8_BACKENDS_TP1 = "tests/test_fp8_backends.py::test_scaled_mm_matches_the_emulation_at_tp1"
BLOCK_DIMS = "tests/test_block_routes.py::test_each_gemm_blocks_along_its_reduction_dim"
TRACED = "tests/test_traced_function_outputs.py"

MUTANTS: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ HybridZeroOptimizer._clip
    Mutant("zero-update-keeps-loss-scale", OPT + "hybrid_zero.py",
           "(1.0 / (scale * dp)) * clip_factor", "(1.0 / dp) * clip_factor",
           "fp16: the update is 65,536x too large (SGD) or eps-blind (AdamW): loss diverges", (LOSS_SCALE,)),
    Mutant("zero-update-sums-over-dp", OPT + "hybrid_zero.py",
           "(1.0 / (scale * dp)) * clip_factor", "(1.0 / scale) * clip_factor",
           "DP=N: gradients summed instead of averaged, an N times larger step than one process", (ZERO_DP2,)),
    Mutant("zero-norm-keeps-loss-scale", OPT + "hybrid_zero.py",
           "grad_norm = self._norm.norm(local) / (scale * dp)", "grad_norm = self._norm.norm(local) / dp",
           "fp16: the logged grad norm is 65,536x too large and clipping shrinks every step", (LOSS_SCALE,)),
    Mutant("zero-norm-sums-over-dp", OPT + "hybrid_zero.py",
           "grad_norm = self._norm.norm(local) / (scale * dp)", "grad_norm = self._norm.norm(local) / scale",
           "DP=N: the grad norm is N times too large, clipping acts where one process would not", (ZERO_DP2,)),
    # ------------------------------------------------------------------ clipping
    Mutant("clip-never-applies", OPT + "clipping.py",
           "    if max_norm > 0:\n", "    if max_norm < 0:\n",
           "clip_grad_norm is silently ignored", (OPTIMIZER,)),
    Mutant("clip-scales-small-gradients-up", OPT + "clipping.py",
           "if coef < 1.0:", "if coef > 0.0:",
           "every gradient is rescaled to norm clip_grad_norm, small ones blown up", (OPTIMIZER, PROMISES_OPTIM)),
    Mutant("clip-eps-dropped", OPT + "clipping.py",
           "coef = max_norm / (grad_norm + 1e-6)", "coef = max_norm / grad_norm",
           "a step whose gradients are all zero (an all-padding batch) crashes with ZeroDivisionError",
           (OPTIMIZER, PROMISES_OPTIM)),
    Mutant("norm-adds-norms-not-squares", OPT + "clipping.py",
           "squares = norms.double().square()", "squares = norms.double()",
           "wrong grad norm (logged and used for clipping)", (OPTIMIZER,)),
    Mutant("norm-not-summed-over-tp", OPT + "clipping.py",
           "    for group in groups:\n        group.all_reduce(sq)",
           "    for group in groups[:0]:\n        group.all_reduce(sq)",
           "TP>1 / ZeRO: each rank clips by its own part of the norm; ranks disagree, TP=N != TP=1",
           (ZERO_DP2, PROMISES_OPTIM)),
    Mutant("norm-counts-replicated-params-on-every-tp-rank", OPT + "clipping.py",
           "counted = [[is_tensor_parallel(p) or groups.tp.rank == 0 for p in b.params]",
           "counted = [[True for p in b.params]",
           "TP=N: norms and biases counted N times, grad norm and clipping differ from TP=1", (PROMISES_OPTIM,)),
    Mutant("norm-never-counts-replicated-params", OPT + "clipping.py",
           "counted = [[is_tensor_parallel(p) or groups.tp.rank == 0 for p in b.params]",
           "counted = [[is_tensor_parallel(p) for p in b.params]",
           "norms and biases left out of the grad norm (even at TP=1)", (OPTIMIZER, PROMISES_OPTIM)),
    Mutant("overflow-not-agreed", OPT + "clipping.py",
           "    if world is not None:\n        world.all_reduce(flag, dist.ReduceOp.MAX)\n"
           "    else:  # TP then DP reaches every rank of a tp x dp layout\n"
           "        tp.all_reduce(flag, dist.ReduceOp.MAX)\n        dp.all_reduce(flag, dist.ReduceOp.MAX)\n",
           "",
           "an inf on one rank: that rank skips, the others step; replicas diverge or the job hangs",
           (PROMISES_OPTIM, OVERFLOW_DP2)),  # the first has the shorter hang guard
    Mutant("overflow-not-agreed-over-dp", OPT + "clipping.py",
           "        tp.all_reduce(flag, dist.ReduceOp.MAX)\n        dp.all_reduce(flag, dist.ReduceOp.MAX)",
           "        tp.all_reduce(flag, dist.ReduceOp.MAX)",
           "without a global group, ZeRO over DP: one DP rank skips, the other steps; replicas diverge",
           (PROMISES_OPTIM,)),
    # ------------------------------------------------------------------ buffers, buckets, groups
    Mutant("accumulation-overwrites", OPT + "buffers.py", "view.add_(grad)", "view.copy_(grad)",
           "gradient accumulation keeps only the last micro-batch", (OPTIMIZER,)),
    Mutant("zero-grad-keeps-gradients", OPT + "buffers.py",
           "                buf.zero_()", "                pass",
           "each step's gradients carry into the next", (OPTIMIZER,)),
    Mutant("dp-all-reduce-dropped", OPT + "buffers.py",
           "                self.dp.all_reduce(buf)", "                pass",
           "DP without ZeRO: each rank trains on its own shard of the batch; replicas diverge", (ZERO_DP2,)),
    Mutant("reduce-scatter-dropped", OPT + "buffers.py",
           "            elif self.reduce_scatter:\n                self.zero1.reduce_scatter_flat(b.grad_flat)",
           "            elif self.reduce_scatter:\n                pass",
           "ZeRO over DP: each rank updates its shard from its own gradients only", (ZERO_DP2,)),
    Mutant("reduce-scatter-into-chunk-0", OPT + "groups.py",
           "return _reduce_scatter(flat.chunk(self.size)[self.rank], flat",
           "return _reduce_scatter(flat.chunk(self.size)[0], flat",
           "ZeRO over DP: ranks other than 0 update from unreduced gradients", (ZERO_DP2,)),
    Mutant("shard-range-always-first", OPT + "bucket.py",
           "self.lo, self.hi = zero1.rank * self.shard, (zero1.rank + 1) * self.shard",
           "self.lo, self.hi = 0, self.shard",
           "ZeRO: every rank updates the first shard; the rest of the model never trains", (ZERO_DP2,)),
    Mutant("publish-skips-all-gather", OPT + "bucket.py",
           "        self.zero1.all_gather_flat(self.param_flat)", "        pass",
           "ZeRO: each rank sees only its own shard's updates; replicas diverge", (ZERO_DP2,)),
    # ------------------------------------------------------------------ master policy, skips
    Mutant("bf16-masters-lose-compensation", OPT + "master_policy.py",
           'comp = self.compensation if b.master.dtype == torch.bfloat16 else "none"', 'comp = "none"',
           "master_compensation=kahan/stochastic does nothing: small updates stall in bf16 masters",
           ("tests/test_lowp_masters.py",)),
    Mutant("sgd-run-as-adamw", OPT + "master_policy.py",
           "return type(optim) is torch.optim.AdamW and not any(", "return not any(",
           "an SGD (or other) inner optimizer silently takes AdamW steps", ("tests/test_fused_update.py",)),
    Mutant("skips-never-count-at-min-scale", OPT + "skips.py",
           'return scaler.scale <= getattr(scaler, "min_scale", math.inf)',
           'return scaler.scale < getattr(scaler, "min_scale", math.inf)',
           "fp16: a diverged run skips forever at the minimum scale instead of stopping",
           ("tests/test_reliability.py::test_fp16_stop_rule_counts_skips_only_at_the_minimum_scale",)),
    Mutant("skips-not-reset-by-a-clean-step", OPT + "skips.py",
           "            self.consecutive_skips = 0\n            self.last_grad_norm = grad_norm\n            return",
           "            self.last_grad_norm = grad_norm\n            return",
           "isolated skips add up and stop a healthy run (TooManySkippedSteps)",
           ("tests/test_reliability.py::test_fp16_stop_rule_counts_skips_only_at_the_minimum_scale",)),
    # ------------------------------------------------------------------ loss scaler
    Mutant("scaler-no-hysteresis", "tessera/precision/scaler.py",
           "if self._hysteresis_step >= self.hysteresis:", "if True:",
           "fp16: every lone overflow halves the loss scale", (SCALER,)),
    Mutant("scaler-overflow-keeps-growth-count", "tessera/precision/scaler.py",
           "            self._growth_step = 0\n            self._hysteresis_step += 1",
           "            self._hysteresis_step += 1",
           "fp16: the scale grows right after an overflow", (SCALER,)),
    Mutant("scaler-backoff-below-min", "tessera/precision/scaler.py",
           "max(self._scale * self.backoff_factor, self.min_scale)", "self._scale * self.backoff_factor",
           "fp16: the loss scale falls below min_scale (to 0 eventually)", (SCALER,)),
    Mutant("scaler-resume-drops-hysteresis", "tessera/precision/scaler.py",
           'self._hysteresis_step = int(state.get("hysteresis_step", 0))', "self._hysteresis_step = 0",
           "fp16: a resumed run backs off later than the uninterrupted one (not bitwise)", (SCALER, PROMISES_OPTIM)),
    # ------------------------------------------------------------------ precision wrapper and switches
    Mutant("amp-fp32-output-not-cast-back", "tessera/core/naive_amp.py",
           "    def _cast_back_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:\n        return "
           "_cast_floating(output, self.dtype)",
           "    def _cast_back_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:\n        return output",
           "an fp32 module's output leaks into the bf16 model (an fp32 norm hands fp32 to the bf16 layers after "
           "it): fp32 activations, more memory", (AMP,)),
    Mutant("amp-fused-head-in-model-dtype", "tessera/core/naive_amp.py",
           "head_dtype = torch.float32 if head is not None and id(head[1]) in in_fp32 else self.dtype",
           "head_dtype = self.dtype",
           "an fp32-marked head fused with the loss computes its logits from bf16 inputs", (AMP,)),
    Mutant("amp-fp32-input-not-cast", "tessera/core/naive_amp.py",
           "return _cast_floating(args, torch.float32), _cast_floating(kwargs, torch.float32)",
           "return args, kwargs",
           "an fp32-marked module computes on bf16 inputs (or fails on a dtype mismatch)", (AMP,)),
    Mutant("amp-head-logits-rounded", "tessera/core/naive_amp.py",
           "            if id(root) not in output_roots:\n", "            if True:\n",
           "an fp32 head's logits come back rounded to bf16", (AMP,)),
    Mutant("amp-marked-weights-cast", "tessera/core/naive_amp.py",
           "target = torch.float32 if id(module) in fp32_ids else self.dtype", "target = self.dtype",
           "fp32-marked modules get bf16/fp16 weights", (AMP,)),
    Mutant("amp-buffers-summed-not-averaged", "tessera/core/naive_amp.py",
           "buf.copy_(tmp.div_(size))", "buf.copy_(tmp)",
           "sync_buffer: floating buffers grow by DP size every forward", (OVERFLOW_DP2,)),
    Mutant("tf32-always-on", "tessera/precision/switches.py", "set_tf32(p.tf32)", "set_tf32(True)",
           "fp32 and mixed runs compute their fp32 GEMMs in TF32 on GPUs", ("tests/test_precision.py",)),
    Mutant("bf16-reduced-precision-reduction-always-on", "tessera/precision/switches.py",
           "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = allowed",
           "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True",
           "bf16 split-K GEMMs reduce in bf16 although the config says fp32", ("tests/test_precision_reductions.py",)),
    Mutant("fp16-accumulation-on", "tessera/precision/switches.py",
           "torch.backends.cuda.matmul.allow_fp16_accumulation = False",
           "torch.backends.cuda.matmul.allow_fp16_accumulation = True",
           "fp16 GEMMs accumulate in fp16 on GPUs", ("tests/test_precision_reductions.py",)),
    # ------------------------------------------------------------------ vocab-parallel loss
    Mutant("lse-without-max-shift", "tessera/parallel/loss.py",
           "row_max = x.max(dim=-1).values", "row_max = x.new_zeros(x.shape[0])",
           "logits above ~88 overflow exp in fp32: loss inf/NaN", (LAYERS, PROMISES_PARALLEL)),
    Mutant("lse-max-not-reduced-over-tp", "tessera/parallel/loss.py",
           "    row_max = x.max(dim=-1).values\n    all_reduce(row_max, group, dist.ReduceOp.MAX)\n",
           "    row_max = x.max(dim=-1).values\n",
           "TP>1: each vocab shard shifts by its own max; the loss is wrong", (LAYERS,)),
    Mutant("loss-chunk-kernels-never-compiled", "tessera/parallel/loss.py",
           "        return _compiled_kernels()\n    return _EAGER", "        return _EAGER\n    return _EAGER",
           "model.compile on (the CUDA default): the fused head's softmax passes run eagerly, the step is slower",
           ("tests/test_chunked_loss.py::test_compiled_chunk_kernels_compute_the_eager_ones",)),
    Mutant("fused-lse-max-not-reduced-over-tp", "tessera/parallel/loss.py",
           "            all_reduce(row_max, group, dist.ReduceOp.MAX)\n", "",
           "TP>1, fused head and loss: each vocab shard shifts by its own max; the loss is wrong",
           ("tests/test_chunked_loss.py::test_vocab_parallel_matches_one_rank",)),
    Mutant("target-logit-not-reduced", "tessera/parallel/loss.py",
           "sum_exp, picked = stacked[0], stacked[1]", "sum_exp, picked = stacked[0], parts[1]",
           "TP>1: ranks that do not hold the target see its logit as 0; loss differs per rank", (LAYERS,)),
    Mutant("smoothing-over-local-vocab", "tessera/parallel/loss.py",
           "label_smoothing * (lse - stacked[2] / vocab)", "label_smoothing * (lse - stacked[2] / v_local)",
           "TP>1 with label smoothing: the loss differs from TP=1", (LAYERS,)),
    Mutant("smoothing-left-out-of-gradient", "tessera/parallel/loss.py",
           "grad = probs.sub_(label_smoothing / vocab) if label_smoothing > 0 else probs", "grad = probs",
           "label smoothing changes the loss but not the gradient", (CHUNKED_FP64,)),
    Mutant("ignored-tokens-in-loss", "tessera/parallel/loss.py",
           "    loss = torch.where(valid, loss, torch.zeros_like(loss))\n", "",
           "padding tokens (ignore_index) add to the loss", (LAYERS,)),
    Mutant("ignored-tokens-get-gradient", "tessera/parallel/loss.py",
           "return grad.mul_((valid * row_scale).unsqueeze(-1))", "return grad.mul_(row_scale.unsqueeze(-1))",
           "padding tokens (ignore_index) train the model", (CHUNKED_FP64,)),
    Mutant("mean-over-all-tokens", "tessera/parallel/loss.py",
           "return loss.sum() / count.clamp(min=1), count", "return loss.sum() / valid.numel(), count",
           "the mean loss divides by padding tokens too: smaller loss and gradients", (LAYERS,)),
    Mutant("chunked-weight-grad-last-chunk-only", "tessera/parallel/loss.py",
           "gw.add_(gw_c)", "gw.copy_(gw_c)",
           "fused head+loss: the head's weight gradient comes from the last chunk of tokens only", (CHUNKED_FP64,)),
    Mutant("chunked-backward-first-chunk-lse", "tessera/parallel/loss.py",
           "kernels.logits_grad(logits, lse[a:b],", "kernels.logits_grad(logits, lse[:b - a],",
           "fused head+loss: gradients of every chunk but the first use another chunk's normaliser",
           (CHUNKED_FP64,)),
    # ------------------------------------------------------------------ parallel layers and collectives
    Mutant("row-bias-before-all-reduce", "tessera/parallel/layers.py",
           "        y = reduce_from_region(self._gemm(x), self.process_group)\n        return y if self.bias is None "
           "else y + self.bias",
           "        y = reduce_from_region(self._gemm(x, self.bias), self.process_group)\n        return y",
           "TP=N: the row-parallel bias is added N times", (LAYERS,)),
    Mutant("embedding-out-of-range-not-masked", "tessera/parallel/layers.py",
           "out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)",
           "out = F.embedding(local_ids, self.weight)",
           "TP>1: every token's embedding gets other ranks' row 0 added", (LAYERS,)),
    Mutant("column-input-grad-not-reduced", "tessera/parallel/layers.py",
           "            if not input_is_copied:\n                x = copy_to_region(x, self.process_group)",
           "            pass",
           "TP>1: the input gradient of a column-parallel layer is one rank's part only", (LAYERS,)),
    Mutant("copy-to-region-no-backward-all-reduce", "tessera/parallel/comm.py",
           "return _all_reduce_copy(grad, ctx.group), None", "return grad, None",
           "TP>1: gradients entering a TP region are partial; TP=N trains differently from TP=1", (LAYERS,)),
    Mutant("gather-along-first-dim", "tessera/parallel/comm.py",
           "return gather_tensor(x, -1, group)", "return gather_tensor(x, 0, group)",
           "gathered outputs (gather_output, parallel_output=False logits) stacked on the batch dim", (LAYERS,)),
    Mutant("scatter-backward-gathers-first-dim", "tessera/parallel/comm.py",
           "return gather_tensor(grad, -1, ctx.group), None", "return gather_tensor(grad, 0, ctx.group), None",
           "a row-parallel layer on a replicated input gets a wrongly shaped/placed input gradient", (LAYERS,)),
    Mutant("msp-gather-backward-not-summed", "tessera/parallel/sequence.py",
           "return reduce_scatter_sequence(grad, ctx.group, ctx.dim), None, None",
           "return sequence_chunk(grad, ctx.group, ctx.dim), None, None",
           "msp: the fused head+loss passes back one rank's part of its input gradient only",
           ("tests/test_chunked_loss.py::test_the_decoder_fused_head_loss_matches_its_unfused_path[2-msp-True-fp32]",)),
    Mutant("msp-row-bias-grad-partial", "tessera/parallel/layers.py",
           "return y if self.bias is None else y + reduce_grad_over_group(self.bias, self.process_group)",
           "return y if self.bias is None else y + self.bias",
           "msp with biases: the row-parallel bias gradient counts one sequence chunk per rank", (MSP_TP2,)),
    Mutant("msp-linears-input-grad-last-layer-only", "tessera/parallel/sequence.py",
           "                        stacked[r].add_(gx)", "                        stacked[r].copy_(gx)",
           "msp: q/k/v (gate/up) share an input whose gradient keeps only the last layer's part", (MSP_TP2,)),
    Mutant("msp-dropout-same-mask-on-every-chunk", "tessera/parallel/sequence.py",
           "noise = sequence_chunk(noise, group, dim).div_(1 - p)",
           "noise = noise.narrow(dim, 0, x.shape[dim]).div_(1 - p)",
           "msp with dropout: every sequence chunk drops the same positions (not mtp's mask)", (MSP_TP2,)),
    # ------------------------------------------------------------------ weight-gradient accumulation fusion
    Mutant("wgrad-hook-adds-the-placeholder", OPT + "buffers.py",
           "            if not take_added(param):", "            if True:",
           "fused linears: the uninitialized placeholder is added on top of the gradient the GEMM added", (WGRAD,)),
    Mutant("wgrad-fused-add-dropped", "tessera/parallel/wgrad.py",
           "        main.addmm_(grad_2d.t().float(), input_2d.float())", "        pass",
           "fp32 linears: the weights' gradients never reach the optimizer; they stop training", (WGRAD,)),
    Mutant("wgrad-head-chunks-not-added", "tessera/parallel/loss.py",
           "            if fused:\n                wgrad_into_main(",
           "            if False:\n                wgrad_into_main(",
           "the fused head's weight gets no gradient: the output layer stops training", (WGRAD,)),
    Mutant("wgrad-compiled-never-resolves", "tessera/parallel/wgrad.py",
           "        return weight\n    return param", "        return weight\n    return weight",
           "compiled blocks (the CUDA default): no weight gradient of a block is fused; the fp32 accumulation "
           "and the saved pass are silently lost", (WGRAD,)),
    Mutant("wgrad-compiled-op-bypassed", "tessera/parallel/gemm.py",
           "        return wgrad.compiled_weight_grad(weight, g2.to(dtype), x2.to(dtype))",
           "        return route.grad_weight(g2, x2, weight, policy, split)",
           "compiled blocks compute their weight gradients unfused although the decoder is meant to fuse them",
           (WGRAD,)),
    # ------------------------------------------------------------------ block formats (MXFP8, NVFP4)
    # (paths spelled out: the list grows by appending)
    Mutant("mx-scale-exponent-off-by-one", "tessera/parallel/block_formats.py",
           "ideal = _exponent(amax) - fmt.emax", "ideal = _exponent(amax) - fmt.emax + 1",
           "mxfp8: every block scale is twice too large: one bit of every element lost, small values flushed",
           ("tests/test_block_formats.py",)),
    Mutant("block-rounding-toward-zero", "tessera/parallel/block_formats.py",
           "return torch.round(v / ulp) * ulp", "return torch.trunc(v / ulp) * ulp",
           "mxfp8 and nvfp4 round toward zero: a bias toward smaller magnitudes in every GEMM operand",
           ("tests/test_block_formats.py",)),
    Mutant("block-elements-not-saturated", "tessera/parallel/block_formats.py",
           "    v = torch.clamp(v, -fmt.max, fmt.max)\n", "",
           "an element above the format's largest value becomes NaN (fp8) or an out-of-range code (fp4) instead "
           "of saturating: FLOOR scales put a sixth of Gaussian blocks' amax there",
           ("tests/test_block_formats.py",)),
    Mutant("rmsnorm-eps-doubled", "tessera/model/norm.py",
           "self.eps = eps", "self.eps = 2 * eps",
           "every RMSNorm divides by sqrt(mean(x^2) + 2 eps): the loss curve moves (1e-4 relative at step 1 of the "
           "tiny config) while every unit test that builds its reference with the module's own eps still passes",
           ("tests/test_golden_curve.py",)),
    # the fp8 backends and the block-format routes (tests/test_fp8_backends.py, tests/test_block_routes.py)
    Mutant("scaled-mm-scale-not-inverted", "tessera/parallel/gemm.py",
           "a_scale.reciprocal().contiguous(), b_scale.reciprocal().contiguous()",
           "a_scale.contiguous(), b_scale.contiguous()",
           "torch._scaled_mm multiplies by the quantization scales instead of dividing: outputs and gradients off "
           "by a factor of scale squared (10^4 and more), the loss diverges",
           (FP8_BACKENDS_TP1,)),
    Mutant("scaled-mm-gradient-in-e4m3", "tessera/parallel/gemm.py",
           "gq, gs = scaled(g.reshape(-1, g.shape[-1]), E5M2", "gq, gs = scaled(g.reshape(-1, g.shape[-1]), E4M3",
           "the scaled_mm backend's input gradient rounds the output gradient to e4m3, not e5m2 as the emulation "
           "and torchao do: the two backends compute different gradients", (FP8_BACKENDS_TP1,)),
    Mutant("auto-picks-scaled-mm-without-fp8-cores", "tessera/parallel/gemm.py", "    if cores:", "    if True:",
           "backend 'auto' runs torch._scaled_mm's reference kernel on a CPU: the same numbers, 10x and more slower",
           ("tests/test_fp8_backends.py::test_auto_backend_picks_the_emulation_without_fp8_tensor_cores",)),
    Mutant("block-weight-along-output-features", "tessera/parallel/gemm.py",
           "y = xq @ _block(w, p, 1, s, s.w_split_in or s.w_split_out).t()",
           "y = xq @ _block(w, p, 0, s, s.w_split_in or s.w_split_out).t()",
           "the forward blocks W across the GEMM's reduction dim: products of one sum no longer share a scale, "
           "which no block-scaled GEMM computes", (BLOCK_DIMS,)),
    Mutant("block-wgrad-along-features", "tessera/parallel/gemm.py",
           "gq = _block(g2, p, 0, s, s.w_split_out, pad=True)", "gq = _block(g2, p, 1, s, s.w_split_out)",
           "the weight gradient blocks the output gradient along the features instead of the tokens it sums over",
           (BLOCK_DIMS,)),
    Mutant("nvfp4-amax-not-agreed-over-tp", "tessera/parallel/gemm.py",
           "if split and s.group is not None and dist.get_world_size(s.group) > 1:", "if False:",
           "each TP shard takes NVFP4's per-tensor scale from its own amax: TP=2 no longer computes TP=1",
           ("tests/test_block_routes.py::test_block_routes_at_tp2_equal_tp1",)),
    Mutant("block-shard-check-skipped", "tessera/precision/linears.py", "        if size % block:", "        if False:",
           "a block recipe on a shard the block does not divide is no longer refused at build time: the run fails "
           "in its first GEMM with a traceback instead of one error line naming the layer",
           ("tests/test_block_routes.py::test_a_shard_the_block_does_not_divide_is_refused_when_the_model_is_built",)),
    Mutant("fp8-rules-last-match-wins", "tessera/precision/linears.py", "for pattern, rule_recipe in rules:",
           "for pattern, rule_recipe in reversed(list(rules)):",
           "model.fp8.rules applies the last matching rule, not the first: a catch-all rule overrides the specific "
           "ones", ("tests/test_block_routes.py::test_rules_give_per_module_recipes_first_match_wins_after_exclude",)),
    Mutant("block-telemetry-underflow-dropped", "tessera/train/precision_telemetry.py",
           'self._sum[row, S["b_under"]] += stats.scale_underflow.double() * blocks', "pass",
           "block_underflow reads 0 in metrics.jsonl whatever the blocks do",
           ("tests/test_precision_telemetry.py::test_block_format_input_saturation_underflow_and_flushed_elements",)),
    # ------------------------------------------------------------------ Function outputs under torch 2.11's Dynamo
    Mutant("traced-swiglu-returns-in-place", "tessera/model/fused_ops.py",
           "            return F.silu(gate) * up  # out of place when traced: see ``_returned``", "            pass",
           "torch 2.11, compiled blocks: every w1, w3 and ffn_norm gradient is zero (the H100 finding)",
           (TRACED + "::test_one_process[bfloat16-False-True]",)),
    Mutant("traced-fp32-output-not-copied", "tessera/model/fused_ops.py",
           "    if t.dtype == dtype and torch.compiler.is_compiling():", "    if False:",
           "torch 2.11, fp32 compiled blocks: the norms' and q/k's gradients are zero",
           (TRACED + "::test_one_process[float32-False-False]",)),
    Mutant("traced-tp-reduce-in-place", "tessera/parallel/comm.py",
           "    if torch.compiler.is_compiling() and group_size(group) > 1 and _check_can_communicate(x, group):",
           "    if False:",
           "torch 2.11, compiled TP: the gradients below every row-parallel layer are zero",
           (TRACED + "::test_tensor_parallel[torch.distributed-mtp]",)),
    Mutant("traced-msp-reduce-scatter-in-place", "tessera/parallel/sequence.py",
           "    if torch.compiler.is_compiling():  # out of place when traced, as comm._all_reduce_copy says why",
           "    if False:",
           "torch 2.11, compiled msp over NCCL/gloo: the gradients below every row-parallel layer are zero",
           (TRACED + "::test_tensor_parallel[torch.distributed-msp]",)),
    # the precision plan and the published recipes (tests/test_precision_plan.py, tests/test_published_recipes.py)
    Mutant("planned-route-ignores-capability", "tessera/precision/routes.py",
           'cores = device_type == "cuda" and hardware.fp8_tensor_cores(capability)', 'cores = device_type == "cuda"',
           "the memory plan of an A100 counts the 3-byte scaled_mm route while the run takes the 4-byte emulated one",
           (PLAN_TESTS + "::test_planned_gemm_bytes_are_those_of_the_route_the_run_takes",)),
    Mutant("legacy-fp8-section-not-read", "tessera/config/loading.py",
           '    ("model", "fp8"): ("model", "low_precision"),', "",
           "a published config with model.fp8 is refused (unknown key) instead of read as model.low_precision",
           (PLAN_TESTS + "::test_a_config_written_with_model_fp8_still_loads_and_says_the_new_name",)),
    Mutant("recipe-state-not-restored", "tessera/precision/linears.py",
           "            s.load_state_dict(dict(state[name]))", "            pass",
           "a resumed run restarts every recipe's RNG stream: its losses leave the uninterrupted run's",
           (PLAN_TESTS + "::test_a_stateful_recipe_trains_and_resumes_bitwise",)),
    Mutant("mxfp8-rceil-ignored", "tessera/parallel/gemm.py",
           "q = fake_quantize(t, p.recipe, dim, amax, scale_rounding=p.scale_rounding)",
           'q = fake_quantize(t, p.recipe, dim, amax, scale_rounding="floor")',
           "mx_scale_rounding='rceil' (the default) still rounds scales down: blocks clip their largest element",
           (RECIPES_TESTS + "::test_rceil_scales_round_up_in_the_route",)),
    Mutant("gw-hp-weight-gradient-quantized", "tessera/parallel/gemm.py",
           "    blockwise_fp8.high_precision_grad_weight, adds_into_main_grad=False,",
           "    _fp8_grad_weight, adds_into_main_grad=False,",
           "rowwise_with_gw_hp quantizes the weight gradient's operands like plain rowwise",
           (RECIPES_TESTS + "::test_rowwise_with_gw_hp_keeps_the_weight_gradient_unquantized",)),
    Mutant("kept-blocks-ignored", "tessera/precision/linears.py",
           "        if chosen is None or _block_index(name) in kept:", "        if chosen is None:",
           "keep_first_blocks / keep_last_blocks (and the presets) leave the end blocks in NVFP4",
           (RECIPES_TESTS + "::test_presets_keep_their_blocks_in_bf16_and_switch_the_rest",)),
    Mutant("forward-schedule-never-switches", "tessera/precision/linears.py",
           "        if self.switched or self.from_step is None or step < self.from_step:", "        if True:",
           "high_precision_forward_from_step does nothing: the forward stays in the recipe to the end",
           (RECIPES_TESTS + "::test_the_forward_switches_to_the_model_dtype_at_the_configured_step",)),
)

EQUIVALENT: tuple[Mutant, ...] = (
    Mutant("eq-scale-one-multiplied", OPT + "hybrid_zero.py",
           "(loss if scale == 1.0 else loss * scale).backward", "(loss * scale).backward",
           "multiplying by 1.0 is exact in every float format: the same gradients; the shortcut only saves a kernel",
           (LOSS_SCALE,)),
    Mutant("eq-zero-always-memsets", OPT + "buffers.py",
           "        if not self.clean:\n            for buf in self.flat_buffers.values():",
           "        if True:\n            for buf in self.flat_buffers.values():",
           "zeroing buffers already known to be zero leaves them zero: only a memset is wasted", (OPTIMIZER,)),
    Mutant("eq-all-reduce-instead-of-reduce-scatter", OPT + "buffers.py",
           "self.reduce_scatter = 1 < zero1.size == dp.size", "self.reduce_scatter = False",
           "every rank then holds the whole DP sum and updates the same shard from it: the same numbers (the norm's "
           "sum runs in another order: rounding only); it costs 1.5x the DP traffic, which the slow "
           "test_zero_over_the_dp_group_moves_what_one_ddp_all_reduce_moves measures", (ZERO_DP2,)),
    Mutant("eq-embedding-ids-clamped-not-zeroed", "tessera/parallel/layers.py",
           "local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)",
           "local_ids = (input_ids - self.vocab_start).clamp(0, self.num_embeddings_per_rank - 1)",
           "an out-of-range id only needs some valid row to look up: the output mask zeroes its embedding and "
           "so its gradient", (LAYERS,)),
    Mutant("eq-chunk-end-not-clamped", "tessera/parallel/loss.py",
           "        b = min(a + spec.chunk_tokens, x.shape[0])\n            logits",
           "        b = a + spec.chunk_tokens\n            logits",
           "slices clamp at the end of the tensor: the last, short chunk is the same rows either way", (CHUNKED_FP64,)),
)
