"""python -m labkit {doctor, run, memory, plan}: the lab from a terminal.

  python -m labkit doctor                        torch, backends, GPUs, cores
  python -m labkit doctor --launch               ready for the workshop? (4 ranks, a plot)
  python -m labkit run single --json             the single-device reference run
  python -m labkit run dp --world-size 4         a technique on 4 ranks (see `run -h`)
  python -m labkit memory --model llama-3-70b    what a real model needs, by category
  python -m labkit run serve --tp 2 --json       generation with a KV cache on ranks
  python -m labkit run serve --requests 32 --rate 50 --paged --max-num-batched-tokens 64
                                                 a request stream, continuously batched
  python -m labkit run serve --requests 8 --draft-layers 2 --draft-len 4
                                                 speculative decoding (--prefill-ranks N:
                                                 prefill on ranks of its own)
  python -m labkit plan --serve --model llama-3-70b --gpus 8 --gpu H100 --batch 64
  python -m labkit plan --serve --model llama-3-8b --gpus 8 --rate 40 --ttft-ms 200 --tpot-ms 50
                                                 batching policies on a stream (modelled)
  python -m labkit plan --model llama-3-70b --gpus 64 --global-batch 512
                                                 which DP x TP x PP layouts fit, and how fast
  python -m labkit calibrate --out profile.json  measure this GPU (plan --gpu-profile FILE)
  python -m labkit gpu-check                     the blocks on NCCL/CUDA, measured vs modelled
"""
import argparse
import ast
import importlib
import importlib.util
import sys

from . import import_whole
from .cli_output import check_writable, finish, out_of_memory, stdout_closed
from .cli_plan import memory_table, plan_arguments, plan_command, serve_plan_main

# technique name on the command line -> the module that implements it
TECHNIQUES = {
    "single": "labkit.runs.single",
    "dp": "labkit.runs.data_parallel",
    "pipeline": "labkit.runs.pipeline",
    "tp": "labkit.runs.tensor_parallel",
    "zero": "labkit.runs.zero",
    "moe": "labkit.runs.moe",
    "hybrid": "labkit.runs.hybrid",
    "cp": "labkit.runs.context_parallel",
}
SHAPE = ("layers", "hidden", "heads", "ffn", "seq", "vocab")  # GPT shape flags (--layers 4 ...)


POSITIVE = ("world_size", "steps", "batch", "gpus", "seq")  # counts that must be at least 1


def main(argv=None):
    """The command line. Exit code 0; 2 for a mistake (one line, no traceback), also a closed
    stdout; 1 for a run that diverged or whose report or trace could not be written (one line
    on stderr, the report still printed where it can be); 130 on Ctrl-C."""
    if stdout_closed():   # `... >&-`: the report would be lost without a word
        print("error: stdout is closed, so the report would be lost: give the command an "
              "output (a terminal, a file or a pipe)", file=sys.stderr)
        return 2
    try:
        return _main(argv)
    except KeyboardInterrupt:  # launch's cleanup has already stopped every rank
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _main(argv):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"] and "--serve" in argv:
        return serve_plan_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="what this machine offers the lab")
    doctor.add_argument("--launch", action="store_true",
                        help="pre-workshop check: 4 ranks all-reduce, a plot renders; "
                             "prints 'ready' or what to fix (exit 0 or 1)")
    run = commands.add_parser("run", help="run a technique and print its report")
    techniques = run.add_subparsers(dest="technique", required=True)
    chosen = _positionals(argv)[1:2] if _positionals(argv)[:1] == ["run"] else []
    for name, module_name in TECHNIQUES.items():
        summary = _summary(module_name)
        if summary is None:   # that lesson is not written yet
            continue
        sub = techniques.add_parser(name, help=summary)
        if [name] == chosen:  # only the technique asked for is imported (with torch)
            _common_run_arguments(sub, default_world_size=1 if name == "single" else 2)
            import_whole(module_name).add_arguments(sub)
    _serve_run_parser(techniques, chosen)
    memory = commands.add_parser("memory", help="memory a real model needs (theory/)")
    memory.add_argument("--model", default="llama-3-70b")
    memory.add_argument("--batch", type=int, default=1)
    memory.add_argument("--seq", type=int, default=4096)
    memory.add_argument("--gpus", type=int, default=8, help="data-parallel size for ZeRO")
    plan_arguments(commands.add_parser(
        "plan", help="which DP x TP x PP layouts of a model fit a cluster, and how fast"))
    calibrate = commands.add_parser("calibrate", help="measure this machine's GPU (GEMM, HBM, "
                                    "decode and training steps, all-reduce) into a profile")
    calibrate.add_argument("--out", default=None, help="write the profile JSON here")
    calibrate.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    check = commands.add_parser("gpu-check", help="every building block on NCCL/CUDA, checked "
                                "against one device; measured vs modelled (make gpu-check)")
    check.add_argument("--out-dir", default="build/gpu-check",
                       help="table.md, profile.json and rows.json go here")
    check.add_argument("--budget-s", type=float, default=280.0,
                       help="parts not started by then are recorded as SKIPPED")
    args = parser.parse_args(argv)
    args.explicit = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    try:
        _check_positive(args)
        if args.command == "doctor":
            from .doctor import doctor_command
            return doctor_command(launch=args.launch)
        elif args.command == "run":
            return finish(*(serve_command(args) if args.technique == "serve"
                             else run_technique(args)))
        elif args.command == "memory":
            return finish(memory_table(args.model, args.batch, args.seq, args.gpus))
        elif args.command == "plan":
            return finish(plan_command(args))
        elif args.command == "calibrate":
            from .calibrate import calibrate_command
            return calibrate_command(out=args.out, quick=args.quick)
        elif args.command == "gpu-check":
            from .gpu_check import gpu_check_command
            return gpu_check_command(out_dir=args.out_dir, budget_s=args.budget_s)
    except Exception as error:  # noqa: BLE001 - a mistake is said plainly, a bug is raised
        oom = out_of_memory(error)
        if not (oom or _plain_mistake(error)):
            raise
        message = oom or (error.args[0] if error.args else error)
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


def _plain_mistake(error):
    """A bad input (ValueError, KeyError) or a failed launch (LaunchError): one line, exit 2."""
    launch = sys.modules.get("labkit.runtime.launch")
    return isinstance(error, (ValueError, KeyError)) or (
        launch is not None and isinstance(error, launch.LaunchError))


def _positionals(argv):
    """The words of argv that are not options: the command, then the technique."""
    return [a for a in argv if not a.startswith("-")]


def _summary(module_name):
    """The first line of a module's docstring, read from its source (no import, so no torch);
    None when the module does not exist."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return None
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.strip().split("\n")[0]


def _check_positive(args):
    """Counts of zero or less end here, in one line (not as negative GB, NaN or a traceback)."""
    for name in POSITIVE:
        value = getattr(args, name, None)
        if value is not None and not value >= 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                             f"got {value}")


def _common_run_arguments(parser, default_world_size):
    parser.add_argument("--world-size", type=int, default=default_world_size)
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cluster", default="8xH100-NVLink",
                        help="the modelled cluster for the virtual clock")
    shape = parser.add_argument_group("model shape (the GPT; defaults: labkit.models.GPTConfig)")
    for name in SHAPE:
        shape.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeline", action="store_true", help="include the timeline in JSON")
    parser.add_argument("--trace", metavar="OUT.json", default=None,
                        help="also write the run's timeline as Chrome trace JSON (Perfetto)")


def run_technique(args):
    from .runs.reference import RunConfig
    from .runs.report import diverged_at, format_table, to_json, to_trace
    module = import_whole(TECHNIQUES[args.technique])
    shape = {k: getattr(args, k) for k in SHAPE if getattr(args, k) is not None}
    if shape and args.model == "mlp":
        raise ValueError(f"--{next(iter(shape))} sets the GPT's shape; drop it with --model mlp")
    for name, value in shape.items():
        if value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value}")
    cfg = RunConfig(model=args.model, steps=args.steps, global_batch=args.batch, lr=args.lr,
                    optimizer=args.optimizer, seed=args.seed, model_kwargs=shape)
    if args.model == "gpt":
        _check_gpt_shape(cfg)
    options = {k: v for k, v in vars(args).items()
               if k not in ("command", "technique", "model", "steps", "batch", "lr",
                            "optimizer", "seed", "json", "timeline", "trace", "world_size",
                            "cluster")
               + SHAPE}
    options.pop("explicit", None)
    if args.trace:
        check_writable(args.trace, "--trace")
    # options that only make sense with another the user gave; the rest of the preflight (bad
    # numbers, runs that cannot fit) comes with the launch: report.launch_checked
    from .runs import preflight
    preflight.check_options(args.technique, cfg, options, explicit=getattr(args, "explicit", ()))
    report = module.report(world_size=args.world_size, cfg=cfg, cluster=args.cluster, **options)
    problems = []
    if args.trace:
        try:
            to_trace(report, args.trace)
        except OSError as error:   # e.g. the disk filled during the run: the report survives
            problems.append(f"--trace {args.trace}: the trace could not be written "
                            f"({error.strerror or error}); the report is on stdout")
    step = diverged_at(report["loss"])
    if step is not None:
        problems.append(f"the run diverged: its loss is {report['loss'][step]} at step {step} "
                        f"(the first non-finite loss); lower --lr (it was {args.lr:g})")
    if not _prints_report():
        return None, problems
    text = to_json(report, timeline=args.timeline) if args.json else format_table(report)
    return text, problems


def _prints_report():
    """Under torchrun every process runs the command: only rank 0 prints the report."""
    import os
    return os.environ.get("RANK", "0") == "0"


def _check_gpt_shape(cfg):
    """A shape the GPT cannot take ends here, in one line, before any rank starts."""
    from .models import GPTConfig
    GPTConfig(**cfg.model_kwargs)   # raises ValueError, e.g. hidden not divisible by heads


# ------------------------------------------------------------------------ serving (lesson 09)

def _serve_run_parser(techniques, chosen):
    """`run serve`: its own options (a batch of requests, not a training batch); they are
    added (importing torch) only when serve is the technique asked for."""
    sub = techniques.add_parser("serve", help="generation with a KV cache on ranks "
                                "(TP, PP, replicas, experts), checked against one device")
    if chosen != ["serve"]:
        return
    from .runs import serve, serve_modes, stream_inputs
    serve.add_arguments(sub)
    serve_modes.add_arguments(stream_inputs.add_arguments(sub))  # --requests N: lesson 10
    sub.add_argument("--world-size", type=int, default=None,
                     help="default: replicas x ep x tp x pp")
    sub.add_argument("--seed", type=int, default=0, help="the model's, the prompts' and (with "
                     "--temperature) each request's draws (vLLM's --seed)")
    sub.add_argument("--cluster", default="8xH100-NVLink",
                     help="the modelled cluster for TTFT/TPOT")
    shape = sub.add_argument_group("model shape (defaults: 4 layers, 4 heads, hidden 64)")
    for name in ("layers", "hidden", "heads", "ffn", "vocab"):
        shape.add_argument(f"--{name}", type=int, default=None)
    sub.add_argument("--json", action="store_true", help="print the report as JSON")


def serve_command(args):
    """`python -m labkit run serve`: the serving report as a table or JSON."""
    from .runs import serve
    from .runs.report import to_json
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "vocab")
             if getattr(args, k) is not None}
    for name, value in shape.items():
        if value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value}")
    from .runs import serve_modes, stream_inputs
    # one rule for the stream's options (runs/stream_inputs.py): an option that does not apply
    # is refused, never ignored
    is_stream = stream_inputs.check_options(args, getattr(args, "explicit", ()))
    if serve_modes.mode(args):        # a draft model or a prefill rank: runs/serve_modes.py
        report = serve_modes.report(args, shape)
        return (to_json(report) if args.json else serve_modes.format_report(report)), ()
    if is_stream:                     # a request stream: runs/stream.py (lesson 10)
        from .runs import stream
        cfg = stream.config_from_args(args, shape)
        if args.world_size not in (None, cfg.world_size):
            raise ValueError(f"--world-size {args.world_size}: a stream runs on tp x replicas "
                             f"= {cfg.tp} x {cfg.replicas} = {cfg.world_size} rank(s); give "
                             f"--tp or --replicas (or drop --world-size)")
        report = stream.report(cfg)
        return (to_json(report) if args.json else stream.format_report(report)), ()
    cfg = serve.config_from_args(args, shape)
    serve.check_config(cfg, args.world_size)
    if shape:
        from .models import GPTConfig
        GPTConfig(**shape)
    report = serve.report(args.world_size, cfg, cluster=args.cluster)
    if args.json:
        return to_json({k: v for k, v in report.items() if k != "tokens"}), ()
    return format_serve_report(report), ()


def format_serve_report(r):
    """What the CLI prints without --json."""
    c = r["config"]
    lines = [f"serve on {r['world_size']} rank(s) (tp {c['tp']}, pp {c['pp']}, replicas "
             f"{c['replicas']}" + (f", {c['experts']} experts over ep {c['ep']}"
                                   if c["experts"] else "") + f"), {r['backend']}",
             f"  {c['batch']} requests x {c['prompt_len']} prompt tokens, {c['new_tokens']} "
             f"new tokens: greedy tokens equal one device: {r['tokens_equal_reference']}",
             "  KV cache per rank (measured / formula, bytes): " + ", ".join(
                 f"r{k}: {v:,} / {r['predicted_kv_cache_bytes'][k]:,.0f}"
                 for k, v in r["kv_cache_bytes"].items())]
    for row in r["comm"]:
        lines.append(f"  comm {row['op']:>10} {row['group']:>12}: {row['calls_per_token']:5.1f} "
                     f"calls, {row['bytes_per_token']:9,.0f} B per token (payload, measured)")
    lines.append(f"  here (measured): {r['wall_tokens_per_s']:.0f} tokens/s, "
                 f"{r['wall_s_per_token'] * 1e3:.1f} ms per step")
    lines.append(f"  on {r['cluster']} (modelled, bf16): TTFT {r['modelled_ttft_s'] * 1e6:.1f} "
                 f"us, TPOT {r['modelled_tpot_s'] * 1e6:.2f} us")
    return "\n".join(lines)
