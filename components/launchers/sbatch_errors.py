"""What a failing ``sbatch`` said, as one paragraph (components/launchers/slurm.py submits the script)."""

from __future__ import annotations

from pathlib import Path

from framework.errors import UserError


def sbatch_failed(proc, script: Path, out: Path) -> UserError:
    """sbatch refused the script (or printed no job id): one paragraph naming its first error line, the
    script it was given (kept, to submit by hand once fixed) and what to check."""
    lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
    said = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "")
    what = f"exited {proc.returncode}" if proc.returncode else "printed no job id"
    check = ("sbatch did not reach the Slurm controller: submit from a host of the cluster (a login node, its "
             "SLURM_CONF)" if any(k in " ".join(lines) for k in UNREACHABLE) else "Check the partition, account, qos "
             "and time limit it asks for (launcher.partition, launcher.account, launcher.qos, launcher.time; `sinfo`, "
             "`sacctmgr show assoc user=$USER`)")
    return UserError("launcher=slurm", f"sbatch {what}" + (f": {said}" if said else " and said nothing") +
                     f". Nothing was submitted; the run folder {out} keeps the script ({script.name}), "
                     "resolved.yaml and an empty logs/.", f"{check}, then submit it by hand: sbatch {script}")


UNREACHABLE = ("contact slurm controller", "resolve_ctls_from_dns_srv", "Unknown host", "Connection refused")  # sbatch's words
