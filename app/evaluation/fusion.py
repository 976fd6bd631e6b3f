"""The fusions a hybrid evaluation row can use, and choosing a fusion's weight on a labelled dev
split (never on the split that is reported).

``--fusion`` takes a comma-separated list of entries: a fusion of :data:`index.FUSIONS` (at
``--weight``), or ``NAME:tuned`` -- its weight chosen on ``--tune-split``'s queries over the
same corpus from :data:`GRID`, by nDCG@10 of the fused top 100 (ties: the weight nearest 0.5),
and stored in the collection (:data:`index.TUNED_PROPERTY`), where a hybrid search that names no
fusion or weight finds it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embedpool.app.evaluation.scoring import score_runs
from embedpool.errors import InvalidError
from embedpool.index import FUSIONS, fuse

#: the weights a tuned fusion chooses from (the vector side's share)
GRID = tuple(i / 20 for i in range(21))
TUNED = "tuned"


@dataclass(frozen=True)
class FusionChoice:
    """One hybrid row's fusion: ``fusion`` at the evaluation's weight, or ``tuned``."""

    fusion: str
    tuned: bool = False

    @property
    def name(self) -> str:
        return f"{self.fusion}:{TUNED}" if self.tuned else self.fusion


def parse_fusions(value: str | Sequence[str]) -> list[FusionChoice]:
    """``"rrf,zscore:tuned"`` (or a list of entries) -> the choices, in order, each once."""
    items = [value] if isinstance(value, str) else list(value)
    out: list[FusionChoice] = []
    for item in (x.strip() for v in items for x in v.split(",")):
        if not item:
            continue
        name, _, option = item.partition(":")
        if name not in FUSIONS or option not in ("", TUNED):
            raise InvalidError(f"--fusion {item!r}: use {', '.join(FUSIONS)}, each optionally with "
                               f":{TUNED} (its weight chosen on --tune-split)", param="--fusion")
        choice = FusionChoice(name, option == TUNED)
        if choice not in out:
            out.append(choice)
    if not out:
        raise InvalidError("--fusion: name at least one fusion", param="--fusion")
    return out


def tune_weight(qrels: dict, qids: Sequence[str], vector_hits: Sequence, lexical_hits: Sequence, fusion: str,
                lower_is_better: bool = False, k: int = 100) -> tuple[float, dict[float, float]]:
    """The weight of :data:`GRID` whose fusion of the two sides' rankings (per query, best first)
    scores the best mean nDCG@10 on ``qrels`` (ties: nearest 0.5), and every weight's score."""
    runs = {}
    for w in GRID:
        runs[str(w)] = {q: {h.id: float(h.score) for h in fuse(v, x, k, fusion, w, lower_is_better=lower_is_better)}
                        for q, v, x in zip(qids, vector_hits, lexical_hits)}
    scores = score_runs(qrels, runs, metrics=("ndcg@10",))
    by_weight = {w: scores[str(w)]["metrics"]["ndcg@10"] for w in GRID}
    best = max(GRID, key=lambda w: (round(by_weight[w], 12), -abs(w - 0.5)))
    return best, by_weight
