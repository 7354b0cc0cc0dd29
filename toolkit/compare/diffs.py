"""apiary compare's differences: loss and grad-norm curves, the probe's step-0 loss, logits and
gradients, and the check of each against the tolerance.
"""

from __future__ import annotations

import math
from pathlib import Path

from toolkit.compare.tolerance import Tolerance


# --------------------------------------------------------------------------- differences
def rel_diff(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b != 0 else math.inf


def _curve(a: list, b: list) -> tuple[float | None, float | None]:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not pairs:
        return None, None
    return max(abs(x - y) for x, y in pairs), max(rel_diff(x, y) for x, y in pairs)


def _tensor_diffs(a_path: Path, b_path: Path) -> dict:
    """Max |a-b| and norm-wise relative difference of two logits tensors."""
    import torch  # reason: start-up time (`apiary --help` imports this package)

    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    if a.shape != b.shape:
        return {"note": f"logits shapes differ: {list(a.shape)} vs {list(b.shape)}"}
    d = (a.double() - b.double())
    nb = float(b.double().norm())
    nd = float(d.norm())
    return {"max_abs": float(d.abs().max()) if d.numel() else 0.0,
            "rel": 0.0 if nd == 0 else (nd / nb if nb else math.inf)}


def _grad_diffs(a_path: Path, b_path: Path) -> dict:
    import torch  # reason: start-up time (`apiary --help` imports this package)

    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    common = [k for k in b if k in a]
    out = {"n_params": len(common), "only_baseline": sorted(set(b) - set(a))[:10],
           "only_variant": sorted(set(a) - set(b))[:10]}
    max_abs, rel, worst = 0.0, 0.0, None
    for k in common:
        x, y = a[k].double(), b[k].double()
        if x.shape != y.shape:
            out.setdefault("shape_mismatch", []).append(k)
            continue
        d = x - y
        if d.numel() == 0:
            continue
        m = float(d.abs().max())
        nd, ny = float(d.norm()), float(y.norm())
        r = 0.0 if nd == 0 else (nd / ny if ny else math.inf)
        max_abs = max(max_abs, m)
        if worst is None or r > rel:
            rel, worst = max(rel, r), k
    out.update(max_abs=max_abs, rel=rel, worst_param=worst if rel > 0 else None)
    return out


def differences(base: dict, var: dict) -> dict:
    d: dict = {}
    n = min(len(base["steps"]), len(var["steps"]))
    d["common_steps"] = n
    d["loss_max_abs"], d["loss_max_rel"] = _curve(var["loss"][:n], base["loss"][:n])
    d["grad_norm_max_abs"], d["grad_norm_max_rel"] = _curve(var["grad_norm"][:n], base["grad_norm"][:n])
    bp, vp = base.get("probe") or {}, var.get("probe") or {}
    if "loss" in bp and "loss" in vp:
        d["step0_loss_abs"] = abs(vp["loss"] - bp["loss"])
        d["step0_loss_rel"] = rel_diff(vp["loss"], bp["loss"])
        d["step0_grad_norm_rel"] = rel_diff(vp["grad_norm"], bp["grad_norm"])
        bdir, vdir = Path(base["dir"]) / "probe", Path(var["dir"]) / "probe"
        if bp.get("logits") and vp.get("logits"):
            t = _tensor_diffs(vdir / vp["logits"]["file"], bdir / bp["logits"]["file"])
            d["logits_max_abs"], d["logits_rel"] = t.get("max_abs"), t.get("rel")
            if "note" in t:
                d["logits_note"] = t["note"]
        else:
            d["logits_note"] = "compared only loss and grads: " + ("; ".join(
                n for n in (bp.get("notes", []) + vp.get("notes", [])) if n.startswith("logits")) or "no logits")
        if bp.get("grads") and vp.get("grads"):
            g = _grad_diffs(vdir / vp["grads"]["file"], bdir / bp["grads"]["file"])
            d["grads_max_abs"], d["grads_rel"], d["grads_worst_param"] = g["max_abs"], g["rel"], g["worst_param"]
            d["grads_n_params"] = g["n_params"]
            if g["only_baseline"] or g["only_variant"] or g.get("shape_mismatch"):
                d["grads_note"] = (f"parameters only in the baseline {g['only_baseline']}, only in the variant "
                                   f"{g['only_variant']}, shapes differ {g.get('shape_mismatch', [])}")
    return d


def check(base: dict, var: dict, tol: Tolerance) -> list[dict]:
    """Violations of ``tol`` by ``var`` (crashes and failed step-0 probes always count)."""
    out = []
    if var["status"] != "ok":
        out.append({"variant": var["label"], "metric": "run", "diff": None, "tol": None,
                    "message": f"{var['label']}: the run {var['status']} (exit {var['returncode']}); "
                               f"see {var['log']}"})
        return out
    error = (var.get("probe") or {}).get("error") or ""
    if error and not error.startswith("probe skipped"):  # nothing at step 0 was compared: the check cannot pass
        first = error.splitlines()[0]
        out.append({"variant": var["label"], "metric": "probe", "diff": None, "tol": None,
                    "message": f"{var['label']}: the step-0 probe failed ({first}); see {var['log']} "
                               f"(--no-probe compares the curves alone)"})
    if var is base or tol.step0 is None:
        return out
    if len(var["steps"]) < len(base["steps"]):
        out.append({"variant": var["label"], "metric": "steps", "diff": len(var["steps"]),
                    "tol": len(base["steps"]), "message": f"{var['label']}: logged {len(var['steps'])} steps, "
                    f"the baseline {len(base['steps'])}"})
    d = var["diff"]
    checks = [("loss curve (max rel over steps)", d.get("loss_max_rel"), tol.curve),
              ("grad norm curve (max rel over steps)", d.get("grad_norm_max_rel"), tol.grad_norm),
              ("step-0 loss (rel)", d.get("step0_loss_rel"), tol.step0),
              ("step-0 logits (norm-wise rel)", d.get("logits_rel"), tol.step0),
              ("step-0 grads (worst parameter, norm-wise rel)", d.get("grads_rel"), tol.step0)]
    for metric, value, t in checks:
        if value is None or t is None:
            continue
        if not value <= t:
            where = f" ({d['grads_worst_param']})" if metric.startswith("step-0 grads") and d.get(
                "grads_worst_param") else ""
            out.append({"variant": var["label"], "metric": metric, "diff": value, "tol": t,
                        "message": f"{var['label']}: {metric}{where} differs by {value:.3e} from "
                                   f"{base['label']}, above the {tol.kind} tolerance {t:g}"})
    return out


