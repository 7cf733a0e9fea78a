"""A model pair as one load sees it: the target's facts and the drafter's config, read and checked against each
other once, then handed to the backend (and to whoever reports on the load). The drafter is a DFlash folder, or
`mtp`: the target's own multi-token-prediction head."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ToolkitError
from ..core.target import TargetInfo
from ..core.tensorfiles import check_folder
from ..dflash import DFlashConfig
from ..mtp import DEPTH, MtpShape, is_mtp, read_mtp


@dataclass(frozen=True)
class ModelPair:
    """A target folder and an optional DFlash drafter folder that fits it, or the target's own MTP head (`mtp`)."""

    target: Path
    draft: Path | None
    info: TargetInfo
    draft_config: DFlashConfig | None
    mtp: MtpShape | None = None

    @classmethod
    def read(cls, target: str | Path, draft: str | Path | None = None) -> ModelPair:
        """Read both folders' configs once and check the drafter against the target (one-line errors); `draft`
        "mtp": the target's own MTP head, which it must carry."""
        mtp = is_mtp(draft)
        target, draft = Path(target), Path(draft) if draft is not None and not mtp else None
        info = TargetInfo.read(target, "target")
        check_folder(target, "--target")                 # every header, before an engine opens the files itself
        if mtp:
            return cls(target, None, info, None, read_mtp(target, info))
        dconf = None
        if draft is not None:
            dconf = DFlashConfig.from_dir(draft)
            check_folder(draft, "--draft")
            try:
                dconf.validate_against(info.config)
            except ToolkitError as e:
                raise ToolkitError(f"drafter {draft} does not fit target {target}: {e}") from None
        return cls(target, draft, info, dconf)

    @property
    def block_size(self) -> int:
        """The drafter's native block (1 without a drafter; the MTP head drafts up to DEPTH ids a round)."""
        if self.mtp is not None:
            return DEPTH + 1
        return self.draft_config.block_size if self.draft_config is not None else 1

    @property
    def folders(self) -> tuple[Path, ...]:
        return (self.target, self.draft) if self.draft is not None else (self.target,)

    @property
    def drafts(self) -> bool:
        """Whether the pair has a drafter (a DFlash folder or the target's MTP head)."""
        return self.draft is not None or self.mtp is not None

    @property
    def synthetic(self) -> bool:
        """Whether the target was written by toolkit.synth (random weights: acceptance means nothing)."""
        return bool((self.info.config.get("quantization_config") or {}).get("synthetic"))
