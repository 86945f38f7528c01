"""Render ``benchmarks.runner.run_bench`` results as BENCHMARKS.md.

Every number in the file comes from the result dict of one run; ratios are paired per round
(median, with min-max over rounds) as described in ``benchmarks.runner``.
"""

from __future__ import annotations

from typing import Any

SECTIONS = (
    "## 1. Framework overhead: tessera step vs plain PyTorch step",
    "## 2. Precisions on this machine: bf16, fp16, fp32, tf32",
    "## 3. Parallelism on the same cores: TP=2 and DP=2 vs one process",
    "## 4. Persistent memory per parameter",
    "## 5. Achieved TFLOP/s and MFU",
    "## 6. GPU",
)

REPRODUCE_GPU = "python -m benchmarks --only-gpu --out BENCHMARKS_GPU.md"


def _f(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _ratio(p: dict[str, float], nd: int = 2) -> str:
    return f"**{p['median']:.{nd}f}** ({p['min']:.{nd}f}-{p['max']:.{nd}f}, n={p['n']})"


def _paired(a: dict[str, Any], b: dict[str, Any], key: str = "times") -> dict[str, float]:
    from benchmarks.runner import paired

    return paired(a[key], b[key])


def _both(a: dict[str, Any], b: dict[str, Any], nd: int = 2) -> str:
    """Wall-clock and CPU-time paired ratios as two table cells."""
    return f"{_ratio(_paired(a, b), nd)} | {_ratio(_paired(a, b, 'cpu'), nd)}"


def header(res: dict[str, Any], command: str) -> list[str]:
    m = res["machine"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["flags"].items())
    mode = res["mode"]
    s = res["single"]
    lines = [
        "# tessera benchmarks",
        "",
        f"Produced by `{command}` on {res['date']} in {res['elapsed_s']:.0f} s (mode `{mode['name']}`), at commit "
        f"`{res['git']['commit']}`" + (f" with `{mode['config']}` modified in the working tree (measured as read at "
                                       "the start of the run)" if res["git"]["config_modified"] else "") + ".",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {m['cpu']}, {m['cores']} cores (torch CPU capability {m['torch_cpu_capability']}) |",
        f"| flags relevant to bf16/fp16 | {flags} |",
        f"| torch / Python | {m['torch']} / {m['python']} |",
        f"| CUDA | {m['cuda'] or 'none'} |",
        f"| CPU bf16/fp16 matmuls in tessera | TESSERA_CPU_LOWP_MATMUL={m['lowp_env']}: bf16 "
        f"{'fp32 GEMMs on bf16 operands (upcast)' if m['bf16_upcast'] else 'torch native kernels'}, fp16 "
        f"{'upcast' if m['fp16_upcast'] else 'native'} |",
        f"| load average (1/5/15 min) | start {res['loadavg_start']}, after single-process sections "
        f"{res['loadavg_mid']}, end {res['loadavg_end']} |",
        f"| model | `{mode['config']}` dims {s['model']}, {s['num_params']:,} parameters, seq_len {s['seq_len']}; "
        f"{s['flops_per_token'] / 1e6:.2f} MFLOP per token (tessera.model.flops_per_token) |",
        "",
        "Method: every variant is built once; after one warm-up step each, the variants run one training "
        "step per round in a rotated order (A B C, B C A, ...). Times are medians over rounds; a ratio is the "
        "median over rounds of the two variants' times *in the same round* (min-max over rounds in brackets), "
        "so a slow phase of this shared machine hits both sides of a ratio alike. Single-process figures are "
        "given as wall clock and as CPU time of the process (`time.process_time`): with one thread, CPU time "
        "leaves out the time the process waited for a core while other processes ran, so it is the steadier "
        "estimate of the step's cost on an idle machine when the machine is loaded. Data: synthetic token rows "
        "(`data.type='synthetic'`, one document per row, so tessera and the plain model both use causal SDPA).",
        "",
    ]
    return lines


def section_overhead(res: dict[str, Any]) -> list[str]:
    s = res["single"]
    main, nat = s["main"], s["native"]
    tb, tf = main["tessera_bf16"], main["tessera_fp32"]
    pb, pf = main["plain_bf16_lowp"], main["plain_fp32"]
    over_bf16 = _paired(tb, pb)
    over_fp32 = _paired(tf, pf)
    lines = [
        SECTIONS[0],
        "",
        f"One process, {s['threads']} thread(s), batch {s['micro_bsz']} x {s['seq_len']} = {s['tokens']} tokens, "
        "TP=1. tessera = `Trainer.train_step` on `NaiveAMPModel` + `HybridZeroOptimizer` (fp32 masters, "
        "fp32 main grads, global-norm clipping), built as train.py builds them. plain = "
        "`benchmarks/plain.py`: nn.Linear/nn.Embedding, RMSNorm, rotary, SDPA, SwiGLU with the same "
        "matmuls and the same initial weights, fp32 cross-entropy, `clip_grad_norm_(1.0)`, `torch.optim.AdamW`; "
        "bf16 under `torch.autocast('cpu', torch.bfloat16)` (fp32 parameters).",
        "",
        "| variant | median step, wall (s) | median step, CPU (s) | tokens/s (wall) | first-step loss |",
        "|---|---:|---:|---:|---:|",
    ]
    rows = [("tessera bf16", tb), ("tessera fp32", tf),
            ("plain fp32", pf),
            ("plain bf16 autocast, GEMMs/attention via tessera.parallel.lowp (= tessera's kernel choice)", pb)]
    for name, v in rows:
        lines.append(f"| {name} | {_f(v['median_s'])} | {_f(v['median_cpu_s'])} | {s['tokens'] / v['median_s']:.0f} | "
                     f"{v['first_loss']:.4f} |")
    lines += [
        "",
        "| time ratio (below 1: tessera faster) | wall clock | CPU time |",
        "|---|---:|---:|",
        "| **framework overhead, bf16**: tessera bf16 / plain bf16 autocast with the same GEMM kernels | "
        f"{_both(tb, pb)} |",
        f"| framework overhead, fp32: tessera fp32 / plain fp32 | {_both(tf, pf)} |",
        f"| tessera bf16 / plain fp32 | {_both(tb, pf)} |",
        "",
        f"Plain `torch.autocast` bf16 uses torch's native bf16 CPU kernels, which are slow on CPUs without bf16 "
        f"instructions ({'not' if _has_native_bf16(res) else 'as'} this one), so that comparison runs at a "
        f"smaller batch ({s['native_tokens']} tokens: micro_bsz "
        f"{res['mode']['native_micro_bsz']} x seq {s['native_seq_len']}), every variant below at that batch, "
        f"{nat['tessera_bf16']['times'].__len__()} round(s):",
        "",
        "| variant (small batch) | median step, wall (s) | median step, CPU (s) | first-step loss |",
        "|---|---:|---:|---:|",
    ]
    for name, key in (("tessera bf16 (auto kernel choice)", "tessera_bf16"),
                      ("tessera bf16, TESSERA_CPU_LOWP_MATMUL=native", "tessera_bf16_native"),
                      ("tessera fp32", "tessera_fp32"),
                      ("plain bf16 torch.autocast (torch native bf16 kernels)", "plain_bf16_autocast"),
                      ("plain bf16 autocast, lowp GEMMs", "plain_bf16_lowp")):
        lines.append(f"| {name} | {_f(nat[key]['median_s'])} | {_f(nat[key]['median_cpu_s'])} | "
                     f"{nat[key]['first_loss']:.4f} |")
    cpu_bf16 = _paired(tb, pb, "cpu")
    lines += [
        "",
        "| time ratio (small batch) | wall clock | CPU time |",
        "|---|---:|---:|",
        f"| tessera bf16 / plain bf16 torch.autocast (native kernels) | "
        f"{_both(nat['tessera_bf16'], nat['plain_bf16_autocast'], 3)} |",
        f"| tessera bf16 / plain bf16 autocast with lowp GEMMs (overhead at this batch) | "
        f"{_both(nat['tessera_bf16'], nat['plain_bf16_lowp'])} |",
        f"| plain bf16 autocast native / plain bf16 autocast lowp (kernel choice alone) | "
        f"{_both(nat['plain_bf16_autocast'], nat['plain_bf16_lowp'])} |",
        "",
        f"Acceptance target (issue): framework overhead in bf16 on the demo model <= 1.10. Measured "
        f"{over_bf16['median']:.2f} wall clock, {cpu_bf16['median']:.2f} CPU time: **"
        + ("met" if max(over_bf16["median"], cpu_bf16["median"]) <= 1.10 else
           "met by one measure only" if min(over_bf16["median"], cpu_bf16["median"]) <= 1.10 else "NOT met")
        + f"** (fp32: {over_fp32['median']:.2f} wall, {_paired(tf, pf, 'cpu')['median']:.2f} CPU).",
        "",
    ]
    return lines


def _has_native_bf16(res: dict[str, Any]) -> bool:
    flags = res["machine"]["flags"]
    return bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))


def _why_bf16_gain_is_small(res: dict[str, Any]) -> str:
    """The verdict's reason on a CPU with bf16 instructions, from this run's peaks and bf16 MFU."""
    s = res["single"]
    peaks = s["peaks"]
    mfu = s["flops_per_token"] * s["tokens"] / s["main"]["tessera_bf16"]["median_s"] / 1e12 / peaks["bf16"]
    ratio = peaks["bf16"] / peaks["fp32"]
    return (f"Why: this CPU has bf16 instructions, and its 1024^3 bf16 matmul peak is {ratio:.2f}x "
            f"the fp32 one (section 5), but a step of this model is not dominated by large GEMMs: all of its FLOPs "
            f"at the bf16 peak would take {100 * mfu:.0f}% of the bf16 step (its MFU). The rest -- elementwise ops, "
            "norms, softmax, the fp32 optimizer update, GEMMs too small to reach the peak -- gains little or "
            "nothing from bf16.")


def section_precision(res: dict[str, Any]) -> list[str]:
    s = res["single"]
    main, nat = s["main"], s["native"]
    lines = [
        SECTIONS[1],
        "",
        f"tessera steps from section 1's rounds (same run, same batch of {s['tokens']} tokens).",
        "",
        "| model.dtype | median step, wall (s) | median step, CPU (s) | tokens/s (wall) | speed-up vs fp32 "
        "(t_fp32 / t_dtype), wall | same, CPU time | skipped steps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for d in ("bf16", "fp16", "fp32", "tf32"):
        v = main[f"tessera_{d}"]
        lines.append(f"| {d} | {_f(v['median_s'])} | {_f(v['median_cpu_s'])} | {s['tokens'] / v['median_s']:.0f} | "
                     f"{_both(main['tessera_fp32'], v)} | {v['skipped_steps']} |")
    bf = _paired(main["tessera_fp32"], main["tessera_bf16"])
    bf_cpu = _paired(main["tessera_fp32"], main["tessera_bf16"], "cpu")
    holds = min(bf["median"], bf_cpu["median"]) >= 1.8
    lines += [
        "",
        f"With torch's native bf16 kernels (`TESSERA_CPU_LOWP_MATMUL=native`, small batch of {s['native_tokens']} "
        "tokens), speed-up of bf16 over fp32 (t_fp32 / t_bf16_native): wall "
        f"{_ratio(_paired(nat['tessera_fp32'], nat['tessera_bf16_native']), 3)}, "
        f"CPU {_ratio(_paired(nat['tessera_fp32'], nat['tessera_bf16_native'], 'cpu'), 3)}.",
        "",
        f"Expectation from the issue: bf16 >= 1.8x faster than fp32. Measured {bf['median']:.2f}x wall clock, "
        f"{bf_cpu['median']:.2f}x CPU time: "
        f"**{'holds' if holds else 'does not hold on this machine'}**. "
        + ("" if holds else "Why: this CPU has no bf16/fp16 matrix instructions (no avx512_bf16, avx512_fp16 "
           "or AMX; see the flags above). A bf16 GEMM can only be computed as an fp32 GEMM on upcast operands "
           "(what tessera does here: same FLOPs at the fp32 rate, plus the conversions) or with torch's reference "
           "bf16 kernels, "
           "which are far slower. Low precision saves memory and bandwidth, but these matmuls are compute-bound, "
           "and elementwise bf16 ops convert to fp32 internally. tf32 is a CUDA compute mode; on the CPU it is "
           "IEEE fp32, so tf32 = fp32 here by construction. The 1.8x+ is a tensor-core property: see section 6."
           if not _has_native_bf16(res) else _why_bf16_gain_is_small(res)),
        "",
    ]
    return lines


def section_parallel(res: dict[str, Any]) -> list[str]:
    p = res["parallel"]
    w = p["world"]
    med = p["median_s"]
    tok = p["tokens"]
    lines = [
        SECTIONS[2],
        "",
        f"bf16, global batch {tok} tokens per step in every layout, {p['rounds']} interleaved rounds. "
        f"1 process x {w} threads (TP=1, DP=1; the other process blocks in a gloo barrier, using no CPU) vs "
        f"{w} gloo processes x 1 thread as TP={w} (each rank the full batch, sharded heads/MLP/vocab) or DP={w} "
        f"(each rank {tok // w} tokens, ZeRO-1 over the {w} DP ranks). Step time = slowest rank. "
        "Communication share = time inside torch.distributed collectives (timers wrapped around "
        "all_reduce/all_gather/... in the bench processes; waiting for the peer counts) / step time, per rank.",
        "",
        f"| layout | median step (s) | tokens/s (job) | throughput vs 1 process x {w} threads | "
        "throughput vs 1 process x 1 thread | comm share (rank 0 / rank 1) | comm s per step (rank 0 / rank 1) | "
        "collectives per step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| 1 process x {w} threads (TP=1, DP=1) | {_f(med['tp1'])} | {tok / med['tp1']:.0f} | 1 | "
        f"{_ratio(p['vs_one_core']['tp1'])} | - | - | 0 |",
    ]
    rows = [("tp2", f"TP={w}: {w} processes x 1 thread, gloo all-reduce"),
            ("tp2_shm", f"TP={w}: {w} processes x 1 thread, shared-memory all-reduce (CPU default)"),
            ("dp2", f"DP={w}, ZeRO-1 {w}: {w} processes x 1 thread")]
    for n, label in [r for r in rows if r[0] in med]:
        sh = " / ".join(f"{100 * x:.1f}%" for x in p["comm_share"][n])
        cs = " / ".join(f"{x:.3f}" for x in p["comm_s"][n])
        lines.append(f"| {label} | {_f(med[n])} | {tok / med[n]:.0f} | {_ratio(p['throughput_ratio'][n])} | "
                     f"{_ratio(p['vs_one_core'][n])} | {sh} | {cs} | {p['comm_calls'][n]} |")
    lines += [
        f"| reference: 1 process x 1 thread | {_f(med['tp1_1thread'])} | {tok / med['tp1_1thread']:.0f} | "
        f"{_ratio(p['throughput_ratio']['tp1_1thread'])} | 1 | - | - | 0 |",
        "",
        f"Speed-ups are paired per round: e.g. TP={w} vs 1 x {w} threads = median over rounds of "
        f"t(1 x {w} threads) / t(TP={w}). On a machine loaded by other processes, a {w}-thread OpenMP process "
        "suffers most (each parallel region waits for its slowest thread, and a thread descheduled by another "
        "process stalls the region), which favours the 1-thread layouts; see the notes.",
        "",
    ]
    if "shm_vs_gloo" in p:
        lines[-1:-1] = [
            f"TP={w} with `tessera.parallel.shm_comm` (ranks on one machine write their tensor into a shared "
            f"segment and each sums the slots itself) vs gloo, same model and batch, paired per round: "
            f"{_ratio(p['shm_vs_gloo'])} the throughput. Gloo hands every collective to worker threads "
            "and sockets, which costs ~1-2 ms per call on this VM whatever the size; `launch` picks the "
            "shared-memory route for a node-local CPU TP group (`dist.cpu_shm_allreduce`, logged).", ""]
    return lines


def section_memory(res: dict[str, Any]) -> list[str]:
    ms, mp = res["memory_single"], res["parallel"]["memory"]
    w = res["parallel"]["world"]
    lines = [
        SECTIONS[3],
        "",
        "Bytes per parameter held after one real training step, summed from the allocated tensors by "
        "`HybridZeroOptimizer.memory_bytes()` (each storage counted once; flat buffers include the padding to a "
        "multiple of the ZeRO size), vs the closed form 2 + 4 + (4 + 8)/d for bf16/fp16 and 4 + 4 + 8/d for "
        f"fp32/tf32 (tessera.train.precision_report.closed_form_bytes). DP={w} rows are rank 0 of {w} processes.",
        "",
        "| dtype | layout | weights | main grads | masters | Adam states | **measured total** | closed form |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for d in ("bf16", "fp16", "fp32", "tf32"):
        for label, row in (("DP=1, ZeRO-1 1", ms[d]), (f"DP={w}, ZeRO-1 1", mp[f"{d}_z1"]),
                           (f"DP={w}, ZeRO-1 {w}", mp[f"{d}_z{w}"])):
            m = row["measured"]
            lines.append(f"| {d} | {label} | {m['weights']:.3f} | {m['main_grads']:.3f} | {m['masters']:.3f} | "
                         f"{m['optimizer_states']:.3f} | **{m['total']:.3f}** | {row['closed_form']['total']:.3f} |")
    lines += [""]
    return lines


def section_mfu(res: dict[str, Any]) -> list[str]:
    s = res["single"]
    fpt = s["flops_per_token"]
    lines = [
        SECTIONS[4],
        "",
        "As train.py computes them: TFLOP/s = flops_per_token x tokens / step time (per process); MFU = that / "
        "the peak, which on a CPU is `metrics.measure_matmul_tflops(dtype)` (a 1024^3 matmul through "
        "`tessera.parallel.lowp.linear`, the kernel the model's linears use), measured in this run with the "
        f"same {s['threads']} thread(s) before and after the timed rounds; the larger of the two is the peak.",
        "",
        "| model.dtype | median step, wall (s) | achieved TFLOP/s | matmul peak TFLOP/s (before / after) | MFU "
        "| MFU from CPU time |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for d in ("bf16", "fp16", "fp32", "tf32"):
        pk = "fp32" if d == "tf32" else d
        v = s["main"][f"tessera_{d}"]
        tf = fpt * s["tokens"] / v["median_s"] / 1e12
        tf_cpu = fpt * s["tokens"] / v["median_cpu_s"] / 1e12
        peak = s["peaks"][pk]
        lines.append(f"| {d} | {_f(v['median_s'])} | {tf:.4f} | {peak:.4f} ({s['peaks_before'][pk]:.4f} / "
                     f"{s['peaks_after'][pk]:.4f}) | {100 * tf / peak:.1f}% | {100 * tf_cpu / peak:.1f}% |")
    lines += [""]
    return lines


def section_gpu(res: dict[str, Any], command: str) -> list[str]:
    g = res.get("gpu")
    lines = [SECTIONS[5], ""]
    if not g:
        lines += [
            "not measured: no CUDA device in this run. To reproduce on a CUDA machine (1B-like dims from "
            "`configs/1B.py`, bf16, TP=1, one GPU):",
            "",
            "```",
            REPRODUCE_GPU,
            "```",
            "",
            "(`python -m benchmarks` measures this section too whenever `torch.cuda.is_available()`.)",
            "",
        ]
        return lines
    tb, pb = g["timed"]["tessera_bf16"], g["timed"]["plain_bf16_autocast"]
    ds = g["datasheet_peak"] or {}
    mp = g["measured_peak"]

    def mfu(tf: float, d: str) -> str:
        sheet = f"{100 * tf / ds[d]:.1f}% of {ds[d]:.0f}" if ds.get(d) else "n/a"
        return f"{sheet} | {100 * tf / mp[d]:.1f}% of {mp[d]:.1f}"

    lines += [
        f"Device: **{g['device']}**; `{g['config']}` dims, seq {g['seq_len']}, TP=1, one process; attention "
        f"backend: {g['attention_backend']}; {len(tb['times'])} interleaved rounds per table. MFU as train.py: "
        "flops_per_token x tokens / step time, against the datasheet dense peak (`metrics.gpu_peak_tflops`) and "
        "against an 8192^3 matmul measured in this run.",
        "",
        f"A. bf16, micro_bsz {g['micro_bsz']} = {g['tokens']} tokens per step (peak memory "
        f"{_f(g['peak_mem_gib'], 1)} GiB "
        "with both models resident):",
        "",
        "| variant | median step (s) | TFLOP/s | MFU vs datasheet | MFU vs measured matmul |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, key, v in (("tessera bf16", "tessera_bf16", tb),
                         ("plain bf16 torch.autocast", "plain_bf16_autocast", pb)):
        tf = g["tflops"][key]
        lines.append(f"| {name} | {_f(v['median_s'], 4)} | {tf:.1f} | {mfu(tf, 'bf16')} |")
    lines += [
        "",
        f"tessera / plain time ratio on this GPU: {_ratio(g['overhead'])}.",
        "",
        f"B. tessera in bf16, tf32 and fp32, micro_bsz {g['micro_bsz_b']} = {g['tokens_b']} tokens per step (three "
        f"optimizers resident, peak memory {_f(g['peak_mem_gib_b'], 1)} GiB):",
        "",
        "| model.dtype | median step (s) | TFLOP/s | MFU vs datasheet | MFU vs measured matmul | bf16 speed-up "
        "(t_dtype / t_bf16) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for d in ("bf16", "tf32", "fp32"):
        v = g["timed_b"][f"tessera_{d}"]
        tf = g["tflops_b"][f"tessera_{d}"]
        sp = "1" if d == "bf16" else _ratio(g["bf16_speedup"][d])
        lines.append(f"| {d} | {_f(v['median_s'], 4)} | {tf:.1f} | {mfu(tf, d)} | {sp} |")
    lines += [""]
    return lines


def notes(res: dict[str, Any]) -> list[str]:
    load = max(res["loadavg_start"][0], res["loadavg_mid"][0], res["loadavg_end"][0])
    cores = res["machine"]["cores"] or 1
    lines = ["## Notes", ""]
    lines += [f"- {n}" for n in res.get("notes", [])]
    if load > 0.75 * cores:
        lines.append(f"- The machine was loaded during this run (1-minute load average up to {load:.1f} on {cores} "
                     "cores, from other processes: other test suites share this machine): absolute times are "
                     "inflated and noisy. Read the paired, interleaved ratios, the CPU-time columns for the "
                     "single-process sections, and the min-max spreads, which show how noisy each figure was.")
    else:
        lines.append(f"- 1-minute load average stayed at or below {load:.1f} on {cores} cores during the run.")
    s, p = res["single"], res["parallel"]
    w = p["world"]
    one_vs_n = p["throughput_ratio"]["tp1_1thread"]["median"]
    if one_vs_n > 1.0:
        lines.append(f"- In this run 1 process x {w} threads was slower than 1 process x 1 thread (1 thread had "
                     f"{one_vs_n:.2f}x its throughput): with other processes holding cores, an OpenMP region of "
                     f"{w} threads waits for whichever thread was descheduled. The {w}-process layouts run one "
                     "thread each and do not have this problem, so their speed-ups over the "
                     f"{w}-thread process overstate what they would be on an idle machine; the column against "
                     "1 process x 1 thread is the steadier scaling figure.")
    tp = "tp2_shm" if "tp2_shm" in p["vs_one_core"] else "tp2"  # the route train.py takes on one CPU node
    slower = [f"{'TP' if n == tp else 'DP'}={w} ({p['vs_one_core'][n]['median']:.2f}x)"
              for n in (tp, "dp2") if p["vs_one_core"][n]["median"] < 1.0]
    if slower:
        lines.append(f"- {' and '.join(slower)} had less throughput than 1 process x 1 thread in this run. On an "
                     f"idle machine the ideal is {w}x; the shortfall is the layout's communication share (section 3) "
                     f"plus, when other processes hold cores (load above), the wait for {w} free cores at once.")
    lines += [
        f"- Single-process sections use {s['threads']} torch thread(s) (`--threads`): fewer threads than cores "
        "keep those timings (and their CPU times) meaningful on a shared machine.",
        "- Communication share counts every moment a rank spends inside a collective, including waiting for the "
        "other rank to arrive; the smaller of the two ranks' figures is the closer estimate of the transfers "
        "themselves. TP moves activations every layer (forward and backward all-reduces); DP moves the gradients "
        "once per step: with ZeRO-1 over the DP group a reduce-scatter of the fp32 grads into each rank's shard "
        "and an all-gather of the updated bf16 parameters (one DDP all-reduce's bytes in all), else one fp32 "
        "all-reduce.",
        "- First-step losses: every variant starts from the same initial weights (the plain model loads "
        "tessera's initial state dict) and the same batch, so equal first-step losses show that both compute "
        "the same model.",
        "- fp16 uses tessera's dynamic loss scaling; 'skipped steps' counts steps skipped for inf/NaN during "
        "the warm-up and the timed rounds.",
        "- tf32 is a CUDA matmul mode: on a CPU `torch.tf32` runs exactly the fp32 code path, so any tf32/fp32 "
        "difference above is noise.",
        "",
    ]
    return lines


def to_markdown(res: dict[str, Any], command: str) -> str:
    parts = header(res, command)
    parts += section_overhead(res)
    parts += section_precision(res)
    parts += section_parallel(res)
    parts += section_memory(res)
    parts += section_mfu(res)
    parts += section_gpu(res, command)
    parts += notes(res)
    return "\n".join(parts).rstrip("\n") + "\n"


def gpu_only_markdown(res: dict[str, Any], command: str) -> str:
    """``--only-gpu``: the command, date, machine and section 6 alone."""
    import datetime

    from benchmarks.runner import machine_info

    m = machine_info()
    lines = ["# tessera benchmarks: GPU section", "",
             f"Produced by `{command}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
             f"host CPU {m['cpu']} ({m['cores']} cores), torch {m['torch']}.", ""]
    return "\n".join(lines + section_gpu(res, command)).rstrip("\n") + "\n"
