"""How many CPUs this process may really use, and how many simulated ranks fit here.

`os.cpu_count()` counts the host's cores; a container or a `taskset` may allow far fewer, and
ranks that each start one thread per host core fight over the few they have.
"""
import os

BYTES_PER_CPU_RANK = 400e6  # a CPU rank (Python + torch + gloo) needs about this much memory


def available_memory(meminfo="/proc/meminfo"):
    """Bytes the system could give us now: MemAvailable on Linux (free memory plus the page
    cache and other memory it can drop), free pages elsewhere; None when the system does not say.
    Never MemFree alone: on any machine that has run for a while the page cache fills it."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_rank_limit(meminfo="/proc/meminfo"):
    """(most simulated ranks worth starting here, why): bounded by available memory (about
    BYTES_PER_CPU_RANK each) and by CPUs (8 ranks per usable CPU); the reason names the limit
    that binds, with its numbers."""
    cpus = usable_cpus()
    by_cpus = 8 * max(2, cpus)
    available = available_memory(meminfo)
    by_memory = by_cpus if available is None else int(available // BYTES_PER_CPU_RANK)
    per_rank = f"about {BYTES_PER_CPU_RANK / 1e6:.0f} MB per rank"
    if by_memory < by_cpus:
        limit = max(2, by_memory)
        return limit, f"at most {limit} ranks: {available / 1e9:.1f} GB available, {per_rank}"
    return by_cpus, f"at most {by_cpus} ranks: {cpus} usable CPU(s), 8 ranks per CPU"


def max_cpu_ranks(meminfo="/proc/meminfo"):
    """The most simulated ranks worth starting here (see `cpu_rank_limit`)."""
    return cpu_rank_limit(meminfo)[0]


def usable_cpus(cgroup_root="/sys/fs/cgroup"):
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (a container
    given 2 CPUs of a 64-core host gets 2, not 64: `os.cpu_count()` counts the host's cores)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    return max(1, cpus)


def cgroup_cpu_quota(root="/sys/fs/cgroup"):
    """CPUs' worth of time the cgroup allows (quota / period), or None when unlimited.

    cgroup v2: `cpu.max` ("max 100000" or "200000 100000"); v1: `cpu.cfs_quota_us` (-1: none)
    over `cpu.cfs_period_us`. Looks in this process's own cgroup, then at the root.
    """
    own = _own_cgroup_paths()
    candidates = [(os.path.join(root, own.get("", "").lstrip("/"), "cpu.max"), None),
                  (os.path.join(root, "cpu.max"), None)]
    for controller in ("cpu", "cpu,cpuacct"):
        base = os.path.join(root, controller)
        for sub in (own.get(controller, "").lstrip("/"), ""):
            folder = os.path.join(base, sub)
            candidates.append((os.path.join(folder, "cpu.cfs_quota_us"),
                               os.path.join(folder, "cpu.cfs_period_us")))
    for quota_file, period_file in candidates:
        try:
            with open(quota_file) as f:
                fields = f.read().split()
            if period_file is not None:
                with open(period_file) as f:
                    fields.append(f.read().strip())
        except OSError:
            continue
        if len(fields) < 2 or fields[0] in ("max", "-1"):
            return None
        try:
            return int(fields[0]) / int(fields[1])
        except (ValueError, ZeroDivisionError):
            return None
    return None


def _own_cgroup_paths():
    """{controller: path} from /proc/self/cgroup ("" is cgroup v2's unified hierarchy)."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    paths[controller] = path
                if controllers:
                    paths[controllers] = path
    except (OSError, ValueError):
        pass
    return paths
