"""The `distill` config section (objectives/distill.py; docs/distill.md). No torch import:
the run config is composed from it before torch loads. beta, lmbda and the completion length
default to TRL 1.16's GKDConfig's; temperature (divergence and sampling) to its
DistillationConfig's."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from slipstream.config_section import ObjectiveSection, option

FSDP_REFUSAL = (
    "train.objective=distill runs with train.parallel=ddp (or none) under torchrun, not fsdp: "
    "the student's head is read outside the sharded forward; set train.parallel=ddp"
)


class DistillSection(ObjectiveSection):
    """train.objective = distill (slipstream/objectives/distill.py)."""

    key: ClassVar[str] = "distill"
    meaning: ClassVar[str] = "the distill objective's settings"

    teacher: str | None = option(
        None, "the teacher: HF folder, .gguf file or hub id, sharing the student's tokenizer"
    )
    teacher_dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "the teacher's weights; auto: as model.dtype"
    )
    teacher_quantization: Literal["none", "nf4"] = option("none", "nf4: a 4-bit teacher")
    beta: float = option(
        0.5, "generalised JSD: 0 forward KL(teacher||student), 1 reverse KL, between a mix",
        ge=0, le=1,
    )  # fmt: skip
    temperature: float = option(1.0, "both distributions' (and on-policy sampling's)", gt=0)
    lmbda: float = option(
        0.5, "chance a micro-batch is on-policy: the student completes its prompts", ge=0, le=1
    )
    max_completion_tokens: int = option(128, "most tokens an on-policy completion has", gt=0)

    def check_run(self, cfg: Any) -> None:
        """A teacher is given; an on-policy completion fits the token budget."""
        if not self.teacher:
            raise ValueError("train.objective=distill needs distill.teacher (a model path or id)")
        if cfg.train.parallel == "fsdp":
            raise ValueError(FSDP_REFUSAL)
        if self.lmbda > 0 and self.max_completion_tokens >= cfg.train.tokens_per_batch:
            raise ValueError(
                f"distill.max_completion_tokens={self.max_completion_tokens} does not fit "
                f"train.tokens_per_batch={cfg.train.tokens_per_batch} with a prompt; lower it "
                "or set distill.lmbda=0 (off-policy only)"
            )
