"""What a served output kind declares: its field, its JSON and file forms, how it is drawn, compared between two
runs and mirrored in detectron2's output dict. numpy-free and torch-free; the kinds are its instances."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

PER = ("picture", "instance")  # a Prediction's field, or each Instance's

# two runs' differences (`d2export evaluate`): what was found differs (a class, a text, a segment) at this severity, a
# count of detections above it; graded differences (a share of pixels, a distance) stay below it and are reported
# only where no categorical one is
CATEGORICAL = 1e5


def same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class PngForm:
    """A per-picture kind's file form, a pixel map of the picture's size: PNG bytes (what `infer` writes as
    `<stem><suffix>`, `batch` as a binary column, `serve` and Triton inline as base64, beside the map's shape) and
    back."""

    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]
    suffix: str  # ".semantic.png"


@dataclass(frozen=True)
class ServedKind:
    """One kind of served output. Every hook gets values that are there (not None) unless it says otherwise."""

    name: str  # the Prediction's or Instance's attribute, and its JSON key (and `batch`'s column)
    per: str  # "picture": a field of Prediction; "instance": a field of each Instance (inside `instances`)
    annotation: str  # the field's type, as its dataclass declares it (default None: a model without it)
    about: str  # one line: what the value holds
    after: str | None = None  # the field it follows in its dataclass (JSON keeps field order); None: the last
    to_json: Callable[[Any], Any] = same  # the value → its JSON form in `to_dict` (a pixel map: {"shape": [h, w]})
    png: PngForm | None = None  # its file form, where it has one (per-picture kinds only)
    # what `--vis` draws: (prediction, class name of a label) → [(mask, colour key, label)], None where the picture
    # lacks the kind; of the kinds with regions, the one of lowest `regions_rank` is drawn
    regions: Callable[[Any, Callable[[int], str]], list[tuple[Any, int, str]] | None] | None = None
    regions_rank: int = 0
    # two runs' values (either may be None) → (severity, one line) where they differ, else None; per-instance kinds
    # are compared per pair of detections
    compare: Callable[[Any, Any], tuple[float, str] | None] | None = None
    # `d2export evaluate` (per-picture kinds): a model's own output dict (detectron2's, torch tensors) and the
    # manifest's postprocess → the value or None; and (a Prediction, postprocess) → the output dict's entries for this
    # kind ({} where the prediction has none). torch is imported inside these only
    from_detectron2: Callable[[dict[str, Any], dict[str, Any]], Any] | None = None
    to_detectron2: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.per not in PER:
            raise ValueError(f"served kind {self.name!r}: per must be one of {PER}, not {self.per!r}")
        picture_only = {"png": self.png, "regions": self.regions, "from_detectron2": self.from_detectron2,
                        "to_detectron2": self.to_detectron2}
        if self.per != "picture" and any(v is not None for v in picture_only.values()):
            raise ValueError(f"served kind {self.name!r}: only a per-picture kind declares "
                             f"{', '.join(k for k, v in picture_only.items() if v is not None)} (a per-instance kind "
                             "is in the instances' JSON, not drawn, and not in detectron2's output dict)")

    @property
    def column(self) -> str | None:
        """`batch`'s Arrow column type for it: "binary" (the PNG bytes) for a kind with a file form, "string" (its
        JSON form as text) for another per-picture kind; None for a per-instance kind (it rides in `instances`)."""
        if self.per != "picture":
            return None
        return "binary" if self.png is not None else "string"
