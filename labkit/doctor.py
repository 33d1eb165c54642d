"""python -m labkit doctor [--launch]: what this machine offers the lab, and whether it is ready.

`doctor` lists Python, torch, the backends, GPUs and cores. `doctor --launch` is the check to run
on every laptop before a workshop: it does what the first lesson does (start 4 ranks with
`labkit.launch`, all-reduce a tensor and check the sum, render a plot to PNG without widgets) and
prints one line, "ready: ..." with the times, or one "fix: ..." line per problem found. Exit
code 0 when ready, 1 when not. Each check is independent, so one run names every problem.
"""
import importlib.util
import io
import multiprocessing
import os
import platform
import socket
import sys
import time

from .runtime.cpus import BYTES_PER_CPU_RANK, available_memory, max_cpu_ranks, usable_cpus

RANKS = 4  # the lessons' usual world size
LAUNCH_TIMEOUT_S = 120.0
# what `make install` puts in .venv (pyproject.toml), by import name
PACKAGES = ("torch", "jupyterlab", "ipywidgets", "matplotlib", "pandas", "tqdm", "cloudpickle")
# what gloo says when it cannot use a network interface or find this host's address
GLOO_ADDRESS_ERRORS = ("Unable to find address", "Unable to resolve hostname",
                       "GLOO_SOCKET_IFNAME", "getaddrinfo", "ifa != nullptr")


def machine_report():
    """Python, torch, cores, backends, GPUs: one line each."""
    import torch
    import torch.distributed as dist
    lines = [f"python        {platform.python_version()} ({sys.executable})",
             f"torch         {torch.__version__}",
             f"cpu cores     {os.cpu_count()}, {usable_cpus()} usable by this process "
             f"(at most {max_cpu_ranks()} simulated ranks here)",
             f"gloo          {'yes' if dist.is_gloo_available() else 'no'}",
             f"nccl          {'yes' if dist.is_nccl_available() else 'no'}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"gpu {i}         {p.name}, {p.total_memory / 2**30:.0f} GiB")
    else:
        lines.append("gpus          none: ranks run on the CPU with gloo (simulated devices)")
    return "\n".join(lines)


def doctor_command(launch=False):
    """Print the machine report; with `launch`, the readiness check. Returns the exit code."""
    print(machine_report())
    if not launch:
        return 0
    fixes, facts = readiness()
    print()
    for fix in fixes:
        print(f"fix: {fix}")
    if not fixes:
        print(f"ready: {'; '.join(facts)}")
    return 1 if fixes else 0


def readiness():
    """([what to fix], [what worked]): every check runs, whatever the others found."""
    fixes, facts = [], []
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        fixes.append(f"missing package(s) {', '.join(missing)}: run `make install` in the lab's "
                     f"folder (or `{sys.executable} -m pip install {' '.join(missing)}`)")
    has_forkserver = "forkserver" in multiprocessing.get_all_start_methods()
    if not has_forkserver:
        fixes.append(f"{platform.system()} has no forkserver, which labkit.launch needs: run "
                     f"the lab in WSL2 on Windows (README, 'Windows'), or on Linux or macOS")
    resources = cores_and_memory(fixes)
    bad_interface = gloo_interface_problem()
    if bad_interface:
        fixes.append(bad_interface)
    if has_forkserver and not bad_interface and "cloudpickle" not in missing:
        _check(launch_check, fixes, facts)
    if "matplotlib" not in missing:
        _check(plot_check, fixes, facts)
    return fixes, facts + resources


def _check(check, fixes, facts):
    fix, fact = check()
    if fix:
        fixes.append(fix)
    else:
        facts.append(fact)


def cores_and_memory(fixes):
    """Append a fix when fewer than 2 cores or too little memory for the ranks; return facts."""
    cores = usable_cpus()
    if cores < 2:
        fixes.append(f"only {cores} usable CPU core: {RANKS} ranks take turns on it and lessons "
                     f"run several times slower; give the machine, VM or container at least 2 "
                     f"(Docker: --cpus 2; WSL2: processors=2 in %UserProfile%\\.wslconfig)")
    available = available_memory()
    needed = RANKS * BYTES_PER_CPU_RANK
    if available is not None and available < needed:
        fixes.append(f"{available / 1e9:.1f} GB of memory available, {RANKS} ranks need about "
                     f"{needed / 1e9:.1f} GB: close other programs (browsers, IDEs) or give the "
                     f"VM more memory (WSL2: memory=4GB in .wslconfig)")
    if max_cpu_ranks() < RANKS:
        fixes.append(f"labkit.launch allows at most {max_cpu_ranks()} CPU ranks here (memory "
                     f"available now, {BYTES_PER_CPU_RANK / 1e6:.0f} MB per rank): free memory")
    memory = "memory unknown" if available is None else f"{available / 1e9:.1f} GB available"
    return [f"{cores} usable cores", memory]


def gloo_interface_problem():
    """A GLOO_SOCKET_IFNAME that names no interface of this machine stops every launch."""
    from .runtime.processes import loopback_interface
    chosen = os.environ.get("GLOO_SOCKET_IFNAME")
    if not chosen:
        return None
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    unknown = [name for name in chosen.split(",") if name not in names]
    if not unknown:
        return None
    return (f"GLOO_SOCKET_IFNAME={chosen} names no network interface here (this machine has "
            f"{', '.join(names)}): unset it (`unset GLOO_SOCKET_IFNAME`; labkit then uses the "
            f"loopback, {loopback_interface()}) or set it to one of those")


def launch_check():
    """(fix, None) or (None, fact): 4 ranks all-reduce rank+1 and must all get 1+2+...+RANKS."""
    from .runtime.launch import LaunchError, launch
    from .runtime.processes import loopback_interface
    expected = RANKS * (RANKS + 1) / 2
    start = time.perf_counter()
    try:
        results = launch(_all_reduce_rank, RANKS, timeout_s=LAUNCH_TIMEOUT_S)
    except (LaunchError, ValueError, OSError) as error:
        return _launch_fix(str(error), loopback_interface()), None
    seconds = time.perf_counter() - start
    sums = [total for total, _, _ in results]
    if any(total != expected for total in sums):
        return (f"the all-reduce of {RANKS} ranks gave {sums}, expected {expected:g} on each: "
                f"torch's gloo is broken here; reinstall torch (`make clean install`)"), None
    backend, interface = results[0][1:]
    over = f"over gloo on {interface or 'the default interface'}" if backend == "gloo" \
        else f"over {backend}"
    return None, (f"{RANKS} ranks started and all-reduced ({expected:g} on each, as expected) "
                  f"{over} in {seconds:.1f} s (first launch, forkserver start included)")


def _all_reduce_rank(ctx):
    import torch
    t = torch.full((4,), float(ctx.rank + 1), device=ctx.device)  # a GPU's under NCCL
    ctx.comm.all_reduce(t)
    return t[0].item(), ctx.backend, os.environ.get("GLOO_SOCKET_IFNAME")


def _launch_fix(message, loopback):
    last = [line for line in message.strip().splitlines() if line.strip()][-1]
    if any(sign in message for sign in GLOO_ADDRESS_ERRORS):
        return (f"gloo cannot use the network interface ({last.strip()[-120:]}): set "
                f"GLOO_SOCKET_IFNAME={loopback or 'lo'} (the loopback) before starting "
                f"Jupyter, or unset a wrong one")
    if message.startswith("timed out"):
        return (f"{RANKS} ranks did not finish one all-reduce in {LAUNCH_TIMEOUT_S:g} s: the "
                f"machine is overloaded, or a firewall blocks connections on the loopback; "
                f"close other programs and run `python -m labkit doctor --launch` again")
    return f"labkit.launch failed ({last.strip()[-160:]}): run `make clean install`, then retry"


def plot_check():
    """(fix, None) or (None, fact): a matplotlib figure rendered to PNG by Agg, no pyplot and
    no widgets, so it works with no display and no browser."""
    start = time.perf_counter()
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        figure = Figure(figsize=(4, 3))
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        ranks = list(range(RANKS))
        axes.bar(ranks, [r + 1 for r in ranks], label="before all-reduce")
        axes.axhline(RANKS * (RANKS + 1) / 2, color="k", label="after")
        axes.set(xlabel="rank", ylabel="value", title="doctor --launch")
        axes.legend()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
    except Exception as error:  # noqa: BLE001 - any failure: say what and how to fix
        return (f"matplotlib cannot render a PNG ({type(error).__name__}: {error}): "
                f"`{sys.executable} -m pip install --force-reinstall matplotlib`"), None
    png = buffer.getvalue()
    if not png.startswith(b"\x89PNG"):
        return "matplotlib wrote no PNG: reinstall it (`make clean install`)", None
    seconds = time.perf_counter() - start
    return None, f"a plot rendered to PNG ({len(png) / 1e3:.0f} kB, Agg) in {seconds:.1f} s"
