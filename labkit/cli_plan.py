"""The planners from a terminal: `plan` (training layouts), `plan --serve` (serving layouts) and
`memory` (a catalog model's bytes by category). All modelled by `labkit.theory`; none imports
torch, so each answers in well under a second on a laptop. `--gpu-profile FILE` (a profile
that `python -m labkit calibrate` measured on a real GPU) replaces the datasheet's peak and HBM
bandwidth in both planners."""
import argparse
import math
import sys

from .cli_output import finish


def plan_arguments(parser):
    """`plan`'s options (the training planner)."""
    parser.add_argument("--model", required=True,
                        help="a catalog name (llama-3-70b) or a shape: layers=48,hidden=6144,"
                             "heads=64,ffn=24576,vocab=51200[,kv_heads=8,experts=8,top_k=2]")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    parser.add_argument("--gpu", default="H100",
                        help="GPU kind: V100, A100, A100-40GB, H100, H100-PCIe, H100-NVL, H200, "
                             "B200, GB200, MI300X, RTX4090")
    parser.add_argument("--gpu-peak-tflops", type=float, default=None,
                        help="a GPU not in the catalog: dense bf16 TFLOP/s (with --gpu-hbm-gb "
                             "and --gpu-hbm-tbps)")
    parser.add_argument("--gpu-hbm-gb", type=float, default=None, help="its memory, GB")
    parser.add_argument("--gpu-hbm-tbps", type=float, default=None, help="its HBM TB/s")
    parser.add_argument("--gpu-fp8-tflops", type=float, default=None,
                        help="its dense fp8 TFLOP/s (for --precision fp8)")
    parser.add_argument("--gpu-profile", default=None, metavar="FILE",
                        help="a profile from `calibrate`: its measured peak bf16 TFLOP/s (best "
                             "large GEMM) and HBM bandwidth replace --gpu's datasheet numbers")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs one NVLink domain joins (default: the GPU's, 8; GB200: 72)")
    parser.add_argument("--intra-link", default=None, help="default: the GPU's own (NVLink)")
    parser.add_argument("--inter-link", default=None, help="default: InfiniBand NDR")
    batch = parser.add_mutually_exclusive_group(required=True)
    batch.add_argument("--global-batch", type=int, help="global batch in sequences")
    batch.add_argument("--global-batch-tokens", type=int, help="global batch in tokens")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length")
    parser.add_argument("--fp8-recipe", default="delayed", choices=("delayed", "current"),
                        help="Transformer Engine's fp8 scaling (current: one more read per cast)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "fp32"),
                        help="fp8: linear layers in fp8 (Transformer Engine), the rest bf16")
    parser.add_argument("--stack", default="megatron",
                        choices=("megatron", "megatron-2021", "fsdp2", "deepspeed", "llama3"),
                        help="which communication the software hides under compute")
    parser.add_argument("--flash", action=argparse.BooleanOptionalAction, default=True,
                        help="FlashAttention (no s^2 softmax kept; --no-flash: unfused)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                        help="causal mask: FlashAttention skips the masked half of the scores, "
                             "and MFU counts only that half (what a causal model needs)")
    parser.add_argument("--fix", default="",
                        help="hold fields: dp=64,tp=8,pp=16,v=2,zero_stage=1,recompute=full,"
                             "recompute_layers=4,sequence_parallel=true")
    parser.add_argument("--top", type=int, default=10, help="plans to show")
    parser.add_argument("--miniature", action="store_true",
                        help="then run the best plan (or --fix's) in miniature on CPU ranks "
                             "and set its measured memory and bytes beside the planner's")
    parser.add_argument("--explain", action="store_true",
                        help="split the best plan's step into GEMMs, attention forward and "
                             "backward, element-wise, optimizer, exposed communication per "
                             "mesh dimension, pipeline bubble and recompute")
    parser.add_argument("--json", action="store_true")


def plan_command(args):
    """`python -m labkit plan`: the planner's ranking as a table or the JSON of
    docs/architecture.md."""
    import json
    from .theory import hardware, planner
    gpu = args.gpu
    custom = (args.gpu_peak_tflops, args.gpu_hbm_gb, args.gpu_hbm_tbps)
    if any(v is not None for v in custom):
        if any(v is None for v in custom):
            raise ValueError("a custom GPU needs --gpu-peak-tflops, --gpu-hbm-gb and "
                             "--gpu-hbm-tbps together")
        gpu = hardware.custom_gpu(*custom, link_name=args.intra_link or "NVLink 4",
                                  fp8_tflops=args.gpu_fp8_tflops)
    check_fix(args.fix)
    header = None
    if getattr(args, "gpu_profile", None):
        from .theory import profile
        if any(v is not None for v in custom):
            raise ValueError("--gpu-profile replaces the custom GPU's numbers: give one of them")
        gpu, header = profile.plan_gpu(args.gpu_profile,
                                       args.gpu if "gpu" in args.explicit else None)
    out = planner.plan(args.model, args.gpus, gpu, args.gpus_per_node, args.intra_link,
                       args.inter_link, global_batch=args.global_batch,
                       global_batch_tokens=args.global_batch_tokens, seq=args.seq,
                       fix=args.fix, top=args.top, flash_attention=args.flash,
                       precision=args.precision, stack=args.stack, causal=args.causal,
                       fp8_recipe=args.fp8_recipe)
    if header:
        out["gpu_profile"] = dict(path=args.gpu_profile, peak_bf16_flops=gpu.bf16_flops,
                                  memory_bw=gpu.memory_bw)
    from .theory import error_band
    # the published check rows ran on their own GPUs, so a profile changes only the H200 rows
    out["error_band"] = error_band.training_band(profiled=bool(header))
    best = out["plans"][0]
    if getattr(args, "explain", False):      # every plan carries it; the best one's on top
        out["explain"] = dict(step_s=best["step_s"], parts_s=best["explain_s"])
    if args.json:
        if getattr(args, "miniature", False):
            out["miniature"] = run_miniature(best)["rows"]
        return json.dumps(out, indent=2)
    band = error_band.format_band(out["error_band"],
                                  best["tokens_per_s_per_gpu"] if best["fits"] else None)
    text = "\n".join(([header] if header else []) + [format_plans(out)] + band + (
        [planner.format_explain(best)] if getattr(args, "explain", False) else []))
    if not getattr(args, "miniature", False):
        return text
    print(text, flush=True)      # the plan first: the miniature run takes seconds
    from .runs import miniature
    family = "" if out["model"]["name"].startswith("gpt") else (
        f"note: {out['model']['display_name']}'s layout runs on a tiny GPT (the mesh trains "
        "no other family): the layout's terms are checked, not this model's layer\n")
    return family + miniature.format_rows(run_miniature(best))


def check_fix(text):
    """--fix gives each field once: `tp=8,tp=4` once served tp=4 without a word."""
    seen = {}
    for part in filter(None, (p.strip() for p in str(text or "").split(","))):
        key, _, value = part.partition("=")
        key = key.strip()
        if key in seen:
            raise ValueError(f"--fix {text}: {key} is given twice ({seen[key]} and "
                             f"{value.strip()}); give each field once")
        seen[key] = value.strip()


def check_serving_rate(out, args):
    """A best plan that serves under half a token per second per GPU (--gpus 1000000000 at
    batch 1: every replica but one idle) prints as 0: say so instead of ranking it."""
    best = out["plans"][0]
    if best["fits"] and not best["reason"] and best["tokens_per_s_per_gpu"] < 0.5:
        raise ValueError(
            f"--gpus {args.gpus}: the best plan serves {best['tokens_per_s_per_gpu']:.2g} "
            f"output tokens/s per GPU ({args.batch or 1:,} request(s) at once on "
            f"{args.gpus:,} GPUs: nearly every GPU idle); give fewer --gpus or a larger "
            "--batch")


def format_plans(out):
    """The training planner's ranking as text (what `python -m labkit plan` prints); all times
    are modelled."""
    from .theory import planner
    c, m = out["cluster"], out["model"]
    lines = [f"{m['display_name']} ({m['params'] / 1e9:.1f}B params) on {c['gpus']} x "
             f"{c['gpu']} ({c['gpus_per_node']} per node, {c['intra_link']} / "
             f"{c['inter_link']}), batch {out['workload']['global_batch']} x "
             f"{out['workload']['seq']} tokens, {c['precision']}, stack {c['stack']}: "
             f"{out['considered']} legal plans, modelled",
             f"{'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>3} {'v':>2} {'mbs':>3} "
             f"{'ZeRO':>4} {'recompute':>11} {'sp':>3} {'GB/GPU':>7} {'step s':>8} {'MFU':>6} "
             f"{'tok/s/GPU':>9}  fits"]
    if out["workload"].get("note"):
        lines.insert(1, "note: " + out["workload"]["note"])
    for p in out["plans"]:
        lines.append(
            f"{p['dp']:>5} {p['tp']:>3} {p['pp']:>3} {p['cp']:>3} {p['ep']:>3} {p['v']:>2} "
            f"{p['micro_batch_size']:>3} {p['zero_stage']:>4} {planner.recompute_label(p):>11} "
            f"{'yes' if p['sequence_parallel'] else 'no':>3} "
            f"{p['memory_bytes']['total'] / 1e9:7.1f} {p['step_s']:8.3f} {p['mfu']:6.1%} "
            f"{p['tokens_per_s_per_gpu']:9.0f}  {'yes' if p['fits'] else p['reason']}")
    return "\n".join(lines)


def run_miniature(best):
    """The best plan run in miniature (runs/miniature.py; torch is imported only here)."""
    from .runs import miniature
    return miniature.miniature({k: best[k] for k in (*miniature.DEFAULTS, "layers_per_stage")})


def memory_table(model_name, batch, seq, gpus):
    """Inference and training bytes for a catalog model, in GB (1e9 bytes)."""
    from .theory import catalog, memory as tm
    m = catalog.model(model_name)
    lines = [f"{m.display_name}: {m.param_count() / 1e9:.2f}B parameters (derived from shapes)",
             "", "inference (weights + KV cache at batch %d, context %d):" % (batch, seq)]
    for dtype in ("bf16", "int8", "int4"):
        inf = tm.inference_memory(m, batch=batch, context=seq, weight_dtype=dtype)
        gb = {k: v / 1e9 for k, v in inf.items()}
        lines.append(f"  {dtype:>5}: weights {gb['weights']:8.1f} GB   "
                     f"KV cache {gb['kv_cache']:6.1f} GB   total {gb['total']:8.1f} GB")
    lines += ["", f"training, mixed-precision Adam, batch {batch} x {seq} tokens, "
              f"{gpus} data-parallel GPU(s):"]
    for stage in range(4):
        tr = tm.training_memory(m, batch=batch, seq=seq, zero_stage=stage, dp=gpus)
        label = "no ZeRO" if stage == 0 else f"ZeRO-{stage}"
        gb = {k: v / 1e9 for k, v in tr.items()}
        lines.append(f"  {label:>8}: params {gb['params']:7.1f}  grads {gb['grads']:7.1f}"
                     f"  optimizer {gb['optimizer']:7.1f}  activations "
                     f"{gb['activations']:7.1f}  total {gb['total']:8.1f} GB")
    return "\n".join(lines)


def serve_plan_main(argv):
    """`python -m labkit plan --serve ...`: the serving planner (its own parser)."""
    import json
    from .theory import serving
    parser = argparse.ArgumentParser(
        prog="python -m labkit plan --serve",
        description="which TP x PP x EP x replicas x weight precision layouts serve a model "
                    "on a cluster, ranked by output tokens/s per GPU (all modelled)")
    parser.add_argument("--serve", action="store_true", required=True)
    parser.add_argument("--model", required=True, help="a catalog name or a shape (see plan)")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--gpu-profile", default=None, metavar="FILE",
                        help="a profile from `calibrate`: its measured peak and HBM bandwidth")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--intra-link", default=None)
    parser.add_argument("--inter-link", default=None)
    parser.add_argument("--prompt-len", type=int, default=None, help="default 1024")
    parser.add_argument("--context", type=int, default=None, help="same as --prompt-len")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=None,
                        help="requests served at once (default 1; with --rate: the old name "
                             "of --max-num-seqs)")
    parser.add_argument("--weights", choices=serving.WEIGHTS, default=None,
                        help="default: try each")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--max-tpot-ms", type=float, default=None)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="vLLM's: no CUDA graphs, the host enqueues kernel by kernel "
                        "(modelled at the fitted host time per kernel of TensorRT-LLM's C++ "
                        "engine; Python's eager loop is slower still)")
    parser.add_argument("--fix", default="", help="hold fields: tp=8,pp=1,ep=1,replicas=1")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    rate = parser.add_argument_group(
        "a request stream (--rate): TTFT, TPOT and goodput of static and continuous batching "
        "and chunked prefill, one bf16 replica per GPU, lengths +-50%% around --prompt-len and "
        "--new-tokens (labkit.theory.stream_sim; modelled)")
    rate.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    rate.add_argument("--requests", type=int, default=200, help="requests in the stream")
    rate.add_argument("--max-num-seqs", type=int, default=None,
                      help="vLLM's: the most requests running per GPU (default 64)")
    rate.add_argument("--max-num-batched-tokens", "--chunk", dest="chunk", type=int,
                      default=None, help="vLLM's: tokens per step of the chunked policy, "
                      "decodes and prompt tokens together (default 512; --chunk: the old name)")
    rate.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="vLLM's: the fraction of each GPU's memory the engine may use; the "
                      "KV pool is what the weights and the activation peak leave of it")
    rate.add_argument("--num-gpu-blocks-override", type=int, default=None,
                      help="vLLM's: the KV pool's blocks (of 16 tokens) per GPU instead")
    rate.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                      default=False, help="vLLM v1's automatic prefix caching (off here "
                      "unless given; it matters with --shared-prefix)")
    rate.add_argument("--shared-prefix", type=int, default=0,
                      help="tokens of one system prompt every prompt begins with")
    rate.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                      help="vLLM's (the modelled stream's requests all have priority 0: "
                      "priority then differs from fcfs only in whom it preempts)")
    rate.add_argument("--ttft-ms", type=float, default=None, help="goodput's TTFT limit")
    rate.add_argument("--tpot-ms", type=float, default=None, help="goodput's TPOT limit")
    rate.add_argument("--seed", type=int, default=0, help="the stream's seed")
    args = parser.parse_args(argv)
    try:
        for name in ("gpus", "new_tokens", "batch", "prompt_len", "context", "top", "requests",
                     "chunk", "max_num_seqs", "num_gpu_blocks_override"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                                 f"got {value}")
        if args.max_tpot_ms is not None and not 0 < args.max_tpot_ms < math.inf:
            raise ValueError(f"--max-tpot-ms must be a positive finite number, got "
                             f"{args.max_tpot_ms}")
        check_fix(args.fix)
        gpu, header = args.gpu, None
        if args.gpu_profile:
            from .theory import profile
            gpu, header = profile.plan_gpu(args.gpu_profile,
                                           args.gpu if "--gpu" in argv else None)
        if args.rate is not None or args.ttft_ms is not None or args.tpot_ms is not None:
            return _stream_plan(args, argv, gpu, header)
        stream_only = [f for f in ("--requests", "--chunk", "--seed", "--max-num-seqs",
                                   "--max-num-batched-tokens", "--gpu-memory-utilization",
                                   "--num-gpu-blocks-override", "--enable-prefix-caching",
                                   "--no-enable-prefix-caching", "--shared-prefix",
                                   "--scheduling-policy")
                       if any(a == f or a.startswith(f + "=") for a in argv)]
        if stream_only:
            raise ValueError(f"{stream_only[0]} shapes a request stream (--rate R); without "
                             "--rate it does not apply: drop it or give --rate")
        out = serving.plan_serving(
            args.model, args.gpus, gpu, prompt_len=args.prompt_len or args.context or 1024,
            new_tokens=args.new_tokens, batch=args.batch or 1, weights=args.weights,
            kv_dtype=args.kv_dtype, max_tpot_ms=args.max_tpot_ms, fix=args.fix,
            gpus_per_node=args.gpus_per_node, intra_link=args.intra_link,
            inter_link=args.inter_link, top=args.top,
            execution="enqueue" if args.enforce_eager else "graph")
        check_serving_rate(out, args)
        from .theory import error_band
        # the published rows ran on their own H100s, so a profile changes only the H200 rows
        out["error_band"] = error_band.serving_band(profiled=bool(header))
    except (ValueError, KeyError) as error:
        message = error.args[0] if error.args else error
        print(f"error: {message}", file=sys.stderr)
        return 2
    if args.json:
        return finish(json.dumps(out, indent=2))
    best = out["plans"][0]
    band = error_band.format_band(out["error_band"], best["tokens_per_s_per_gpu"]
                                  if best["fits"] and not best["reason"] else None,
                                  unit="output tokens/s per GPU")
    # finish: a stdout that refuses the text (> /dev/full) is one line and exit 1
    return finish("\n".join(([header] if header else []) + [serving.format_serving_plans(out)]
                             + band))


def _stream_plan(args, argv, gpu, header):
    """`plan --serve --rate R`: each batching policy on a modelled stream (table or JSON)."""
    import json
    from .theory import stream_sim
    if args.rate is None:
        raise ValueError("--ttft-ms and --tpot-ms judge a request stream: give its --rate")
    layout = [f for f in ("--fix", "--weights", "--max-tpot-ms", "--top") if f in argv]
    if layout:
        raise ValueError(f"--rate models one bf16 replica per GPU, so {layout[0]} (a layout "
                         "planner option) does not apply; drop it or drop --rate")
    if args.batch is not None and args.max_num_seqs is not None:
        raise ValueError("--batch is the old name of --max-num-seqs: give one of them")
    out = stream_sim.plan_stream(
        args.model, args.gpus, gpu, rate=args.rate, requests=args.requests,
        prompt_len=args.prompt_len or args.context or 1024, new_tokens=args.new_tokens,
        max_num_seqs=args.max_num_seqs or args.batch or 64,
        max_num_batched_tokens=args.chunk or stream_sim.CHUNK, ttft_ms=args.ttft_ms,
        tpot_ms=args.tpot_ms, kv_dtype=args.kv_dtype, seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching, shared_prefix=args.shared_prefix,
        scheduling_policy=args.scheduling_policy,
        execution="enqueue" if args.enforce_eager else "graph")
    if args.json:
        return finish(json.dumps(out, indent=2))
    return finish((header + "\n" if header else "") + stream_sim.format_stream_plan(out))
