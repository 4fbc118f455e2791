"""`slipstream plan CONFIG`: the memory plan of a run, printed before any weight loads."""

from __future__ import annotations

from slipstream.memory.plan import (
    GiB,
    PlanInputs,
    choose,
    device_budget,
    format_plan,
    longest,
    read_hf_config,
)


def plan_report(cfg, device: str | None = None, budget: int | None = None) -> str:
    """The configured plan by component, the longest sequence it allows, and what
    `train.memory=auto` would pick (with the longest sequence that allows)."""
    from slipstream.models import check_model_type

    if device is None:
        device = "cuda" if budget is not None else _config_device(cfg.train.device)
    hf = read_hf_config(cfg.model.path)
    if hf is None:
        raise ValueError(
            f"model.path={cfg.model.path}: no config.json to plan from (a GGUF file or a hub "
            "id not downloaded yet); plan from the model's folder"
        )
    check_model_type(hf.get("model_type"), f"{cfg.model.path}/config.json")
    if budget is None and device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda on a machine without CUDA: give --gpu-memory 80GB")
    budget = budget if budget is not None else device_budget(device)
    inp = PlanInputs.from_config(cfg, device, hf)
    plan = choose(inp, budget, auto=cfg.train.memory == "auto")
    out = [format_plan(plan, longest(inp, plan))]
    best = choose(inp, budget, auto=True)
    if (best.mode, best.tiles) != (plan.mode, plan.tiles):
        out.append(
            f"with train.memory=auto: {', '.join(best.techniques) or 'no checkpointing'}, "
            f"peak {best.peak / GiB:.2f} GiB"
        )
    most = choose(_most_saving(inp), None, auto=False)
    out.append(
        f"longest single sequence with every technique ({', '.join(most.techniques)}): "
        f"{longest(inp, _with_budget(most, budget)):,} tokens"
    )
    return "\n".join(out)


def _config_device(name: str) -> str:
    if name != "auto":
        return "cuda" if name.startswith("cuda") else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _most_saving(inp: PlanInputs) -> PlanInputs:
    import dataclasses

    mode = "offload" if inp.device == "cuda" else "recompute"
    return dataclasses.replace(inp, mode=mode, tiles=64)


def _with_budget(plan, budget):
    plan.budget = budget
    return plan
