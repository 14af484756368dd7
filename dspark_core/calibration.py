"""Confidence calibration: ECE / AUROC / Brier per draft position and Sequential Temperature Scaling.

Inputs are plain tensors: raw confidence-head logits ``conf_logits`` [N, G] of N drafted blocks and the
number of accepted draft tokens ``accepted`` [N] of each block, from rounds whose whole block was
verified (shadow verification; a truncated round's labels are censored and would bias the fit toward
optimism, see docs/training.md). The label of position k (1-based) is "the prefix 1..k was fully accepted".
The calibrated survival of position k is a_k = prod_{i<=k} sigmoid(g_i / T_i + b_i): a temperature T_i
per position (Sequential Temperature Scaling) and, optionally, a shift b_i per position. Temperature
alone only changes the spread; a head that is confidently wrong on average (mean prediction far from
the acceptance rate) needs the shift.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import torch

DEFAULT_GRID = tuple(round(0.25 + 0.05 * i, 2) for i in range(76))        # 0.25 .. 4.00
SHIFT_GRID = tuple(round(-4.0 + 0.1 * i, 1) for i in range(81))          # -4.0 .. 4.0


def prefix_labels(accepted: torch.Tensor, G: int) -> torch.Tensor:
    """accepted [N] counts -> labels [N, G] with labels[:, k-1] = (accepted >= k)."""
    return (accepted[:, None] >= torch.arange(1, G + 1)[None]).float()


def survival(conf_logits: torch.Tensor, temperatures: torch.Tensor | None = None,
             shifts: torch.Tensor | None = None) -> torch.Tensor:
    """[N, G] raw logits (optionally / per-position temperatures [G], + shifts [G]) -> cumulative survival."""
    z = conf_logits.float()
    if temperatures is not None:
        z = z / temperatures.float()
    if shifts is not None:
        z = z + shifts.float()
    return torch.cumprod(torch.sigmoid(z), dim=-1)


def ece(pred: torch.Tensor, label: torch.Tensor, bins: int = 15, min_count: int = 1) -> float:
    """Expected calibration error with equal-width bins: sum_b (n_b / N) |mean pred_b - mean label_b|.

    Bins with fewer than ``min_count`` samples are left out of the sum (and of N).
    """
    pred, label = pred.float().flatten(), label.float().flatten()
    if pred.numel() == 0:
        return 0.0
    idx = (pred * bins).long().clamp(0, bins - 1)
    n = torch.bincount(idx, minlength=bins)
    gap = (torch.bincount(idx, weights=pred, minlength=bins) - torch.bincount(idx, weights=label, minlength=bins)).abs()
    keep = n >= max(1, min_count)                      # n_b |mean pred - mean label| = |sum pred - sum label|
    used = int(n[keep].sum())
    return float(gap[keep].sum()) / used if used else 0.0


def ece_floor(pred: torch.Tensor, bins: int = 15, draws: int = 200, seed: int = 0) -> float:
    """The ECE a perfectly calibrated predictor shows on these predictions: labels drawn from
    Bernoulli(pred), mean over ``draws`` draws (seeded).

    Binned ECE is biased upward by sampling noise: a bin of n samples at probability p is off by about
    sqrt(2 p (1 - p) / (pi n)) on average even when calibrated, so the floor falls as 1 / sqrt(N). A
    measured ECE at or below this floor is as calibrated as the sample can show; a goal below it needs
    more rounds, not a better fit."""
    pred = pred.float().flatten()
    if pred.numel() == 0:
        return 0.0
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand((draws, pred.numel()), generator=g) < pred[None]).float()
    return sum(ece(pred, labels[i], bins) for i in range(draws)) / draws


def _worst_ece(pred: torch.Tensor, label: torch.Tensor, bins: int) -> float:
    return max(ece(pred[:, k], label[:, k], bins) for k in range(pred.shape[1]))


def _block_resamples(N: int, block: int, draws: int, seed: int):
    """Row indices of ``draws`` moving-block bootstrap resamples of N rows in arrival order: ``block``
    consecutive rows at a time, seeded."""
    block = max(1, min(int(block), N))
    n_blocks = -(-N // block)
    g = torch.Generator().manual_seed(seed)
    for _ in range(draws):
        starts = torch.randint(0, N - block + 1, (n_blocks,), generator=g)
        yield (starts[:, None] + torch.arange(block)[None]).flatten()[:N]


def worst_ece_spread(pred: torch.Tensor, label: torch.Tensor, block: int = 128, draws: int = 200,
                     quantiles: tuple[float, float] = (0.05, 0.95), bins: int = 15, seed: int = 0) -> list[float]:
    """How far the worst position's ECE of ``pred`` [N, G] against ``label`` [N, G] would move on another
    sample of the same traffic: a moving-block bootstrap over the rounds (rows in arrival order, resampled
    ``block`` consecutive rows at a time, seeded), its ``quantiles`` taken as distances from the
    resamples' median and laid around the measured figure. Returns [low, high].

    Resampling repeats rows, and a binned ECE on fewer distinct rows reads higher, so the resamples' own
    quantiles sit above the measured figure (on 8,192 recorded code rounds the figure fell at their 5 %
    quantile); their width, though, matched how much the figure moved between replays of the same rounds
    in other request orders. Blocks keep a request's consecutive rounds together, since they share its
    acceptance. Read the result as one run's spread, not as a corrected ECE."""
    pred, label = pred.float(), label.float()
    N = pred.shape[0]
    if N == 0:
        return [0.0, 0.0]
    measured = _worst_ece(pred, label, bins)
    w = torch.tensor([_worst_ece(pred[idx], label[idx], bins) for idx in _block_resamples(N, block, draws, seed)])
    lo, mid, hi = (float(x) for x in torch.quantile(w, torch.tensor([quantiles[0], 0.5, quantiles[1]])))
    return [round(max(0.0, measured - (mid - lo)), 5), round(measured + (hi - mid), 5)]


def paired_worst_ece_difference(pred_a: torch.Tensor, pred_b: torch.Tensor, label: torch.Tensor, block: int = 128,
                                draws: int = 200, quantiles: tuple[float, float] = (0.05, 0.95), bins: int = 15,
                                seed: int = 0) -> dict:
    """Worst-position ECE of ``pred_a`` minus that of ``pred_b`` [N, G], both judged on the same labels
    [N, G] (two calibrations of the same rounds), with the ``quantiles`` of that difference over a
    moving-block bootstrap of the rounds (:func:`worst_ece_spread`'s resampling, each resample applied to
    both). Returning {"value", "low", "high"}: a range that excludes 0 is a difference these rounds
    resolve. The range narrows only as far as the two calibrations' errors are shared: two live
    calibrators with different refit histories read a range about as wide as each figure's own spread."""
    pred_a, pred_b, label = pred_a.float(), pred_b.float(), label.float()
    N = label.shape[0]
    if N == 0:
        return {"value": 0.0, "low": 0.0, "high": 0.0}
    value = _worst_ece(pred_a, label, bins) - _worst_ece(pred_b, label, bins)
    diffs = [_worst_ece(pred_a[idx], label[idx], bins) - _worst_ece(pred_b[idx], label[idx], bins)
             for idx in _block_resamples(N, block, draws, seed)]
    lo, hi = (float(x) for x in torch.quantile(torch.tensor(diffs), torch.tensor(list(quantiles))))
    return {"value": round(value, 5), "low": round(lo, 5), "high": round(hi, 5)}


def auroc(pred: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count one half); 0.5 when one class is absent."""
    pred, label = pred.float().flatten(), label.bool().flatten()
    pos, neg = pred[label], pred[~label]
    if pos.numel() == 0 or neg.numel() == 0:
        return 0.5
    greater = (pos[:, None] > neg[None, :]).float().sum()
    ties = (pos[:, None] == neg[None, :]).float().sum()
    return float((greater + 0.5 * ties) / (pos.numel() * neg.numel()))


def brier(pred: torch.Tensor, label: torch.Tensor) -> float:
    return float(((pred.float() - label.float()) ** 2).mean()) if pred.numel() else 0.0


def position_metrics(surv: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> list[dict]:
    """Per position: ECE, AUROC, Brier, mean prediction, mean label, count, and the ECE floor of a perfectly
    calibrated predictor on the same sample (:func:`ece_floor`)."""
    out = []
    for k in range(surv.shape[1]):
        p, y = surv[:, k], labels[:, k]
        out.append({"position": k + 1, "ece": round(ece(p, y, bins), 5), "auroc": round(auroc(p, y), 5),
                    "brier": round(brier(p, y), 5), "mean_pred": round(float(p.mean()), 5),
                    "mean_label": round(float(y.mean()), 5), "count": int(p.numel()),
                    "ece_floor": round(ece_floor(p, bins), 5)})
    return out


@dataclass
class Calibration:
    """Per-position temperatures (and shifts) plus the evidence they were fitted on (a small JSON artifact)."""

    temperatures: list[float]
    rounds: int
    shifts: list[float] = field(default_factory=list)   # empty = no shift
    raw: list[dict] = field(default_factory=list)
    calibrated: list[dict] = field(default_factory=list)
    drafter: str = ""
    target_fingerprint: str = ""
    fallback: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        return cls(**d)

    @classmethod
    def identity(cls, G: int) -> "Calibration":
        return cls([1.0] * G, 0)

    @staticmethod
    def _per_position(values: list[float], G: int, default: float) -> torch.Tensor:
        vals = list(values) or [default]
        return torch.tensor(vals[:G] + [vals[-1]] * max(0, G - len(vals)))

    def apply(self, conf_logits: torch.Tensor) -> torch.Tensor:
        """Raw logits [..., G] -> calibrated per-step probabilities sigmoid(g / T + b) [..., G]."""
        G = conf_logits.shape[-1]
        t = self._per_position(self.temperatures, G, 1.0).to(conf_logits.device)
        b = self._per_position(self.shifts, G, 0.0).to(conf_logits.device)
        return torch.sigmoid(conf_logits.float() / t + b)

    def survival(self, conf_logits: torch.Tensor) -> torch.Tensor:
        """Raw logits [N, G] -> calibrated cumulative survival [N, G]."""
        return torch.cumprod(self.apply(conf_logits), dim=-1)


@dataclass(frozen=True)
class STSConfig:
    """How :func:`fit_sts` searches: the parameter grids and its small-sample guards."""

    grid: tuple[float, ...] = DEFAULT_GRID          # temperatures T_k tried
    shift: bool = False                             # also fit a shift b_k per position
    shift_grid: tuple[float, ...] = SHIFT_GRID      # shifts b_k tried (with ``shift``)
    bins: int = 15                                  # ECE bins
    min_bin_count: int = 10                         # fewer samples: a bin, or a position's class, does not count
    min_rounds: int = 200                           # fewer rounds: keep the previous calibration
    # "grid" scores every (T, b) pair; "refine" scores every ``stride``-th pair of each grid, then every pair
    # within ``stride`` grid steps of the ``keep`` best: about a tenth of the pairs on the default grids
    search: str = "grid"
    stride: int = 4
    keep: int = 8


def fit_sts(conf_logits: torch.Tensor, accepted: torch.Tensor, cfg: STSConfig = STSConfig(),
            previous: Calibration | None = None) -> Calibration:
    """Sequential Temperature Scaling: for k = 1..G pick T_k on ``cfg.grid`` (with ``cfg.shift``, the pair
    (T_k, b_k) on ``grid`` x ``shift_grid``) minimising the ECE of the calibrated survival a_k against
    "prefix 1..k accepted", with positions 1..k-1 fixed.

    Robust for small samples: parameters are bounded by the grids, bins with fewer than
    ``min_bin_count`` samples do not count in the objective, a parameter moves away from the identity
    only for an ECE gain above 1e-4 (ties go to the pair closest to T = 1, b = 0), a position with fewer
    than ``min_bin_count`` accepted (or rejected) prefixes keeps the identity, and with fewer than
    ``min_rounds`` rounds the ``previous`` calibration (or identity) is kept, with a warning.
    """
    if conf_logits.dim() != 2 or accepted.shape != conf_logits.shape[:1]:
        raise ValueError(f"conf_logits must be [N, G] and accepted [N]; got {tuple(conf_logits.shape)} and "
                         f"{tuple(accepted.shape)}")
    N, G = conf_logits.shape
    labels = prefix_labels(accepted, G)
    raw = position_metrics(survival(conf_logits), labels, cfg.bins)
    if N < cfg.min_rounds:
        warnings.warn(f"STS refit skipped: {N} fully verified rounds < {cfg.min_rounds}; keeping the "
                      f"{'previous' if previous else 'identity'} calibration", RuntimeWarning, stacklevel=2)
        base = previous or Calibration.identity(G)
        cal = Calibration(list(base.temperatures), N, list(base.shifts), raw, fallback=True)
        cal.calibrated = position_metrics(cal.survival(conf_logits), labels, cfg.bins)
        return cal
    if cfg.search not in ("grid", "refine"):
        raise ValueError(f"STSConfig.search must be 'grid' or 'refine', got {cfg.search!r}")
    shifts_grid = tuple(cfg.shift_grid) if cfg.shift else (0.0,)
    temps: list[float] = []
    shifts: list[float] = []
    prefix = torch.ones(N)
    for k in range(G):
        g = conf_logits[:, k].float()
        best_tb, best = (1.0, 0.0), float("inf")
        positives = int(labels[:, k].sum())
        # with (almost) one class only, any small T "wins" by pushing survival to 0 or 1: no evidence,
        # the position keeps the identity
        if min(positives, N - positives) >= cfg.min_bin_count:
            scored = _search_pairs(g, prefix, labels[:, k], tuple(cfg.grid), shifts_grid, cfg)
            for (t, b), e in sorted(scored.items(), key=lambda kv: abs(kv[0][0] - 1.0) + abs(kv[0][1])):
                if e < best - 1e-4:                   # move away only for a real gain; ties: closest to identity
                    best, best_tb = e, (t, b)
        temps.append(best_tb[0])
        shifts.append(best_tb[1])
        prefix = prefix * torch.sigmoid(g / best_tb[0] + best_tb[1])
    cal = Calibration(temps, N, shifts if cfg.shift else [], raw)
    cal.calibrated = position_metrics(cal.survival(conf_logits), labels, cfg.bins)
    return cal


def _search_pairs(g: torch.Tensor, prefix: torch.Tensor, label: torch.Tensor, temps: tuple[float, ...],
                  shifts: tuple[float, ...], cfg: STSConfig) -> dict[tuple[float, float], float]:
    """ECE of the (T, b) pairs :func:`fit_sts` scores for one position: every pair of the grids, or (``cfg.search``
    "refine") a coarse pass over every ``stride``-th pair, identity included, then the pairs around its
    ``keep`` best."""
    if cfg.search == "grid":
        pairs = [(t, b) for t in temps for b in shifts]
        return dict(zip(pairs, _ece_of_pairs(g, prefix, label, pairs, cfg)))
    s = max(1, cfg.stride)

    def coarse(values: tuple[float, ...], ident: float) -> set[int]:
        idx = set(range(0, len(values), s)) | {len(values) - 1}
        if ident in values:
            idx.add(values.index(ident))
        return idx

    scored: dict[tuple[int, int], float] = {}

    def score(cells: list[tuple[int, int]]) -> None:
        cells = [c for c in cells if c not in scored]
        pairs = [(temps[i], shifts[j]) for i, j in cells]
        scored.update(zip(cells, _ece_of_pairs(g, prefix, label, pairs, cfg) if pairs else []))

    score([(i, j) for i in sorted(coarse(temps, 1.0)) for j in sorted(coarse(shifts, 0.0))])
    for i0, j0 in sorted(scored, key=scored.get)[:max(1, cfg.keep)]:
        score([(i, j) for i in range(max(0, i0 - s + 1), min(len(temps), i0 + s))
               for j in range(max(0, j0 - s + 1), min(len(shifts), j0 + s))])
    return {(temps[i], shifts[j]): e for (i, j), e in scored.items()}


def ece_rows(pred: torch.Tensor, label: torch.Tensor, bins: int = 15, min_count: int = 1) -> torch.Tensor:
    """:func:`ece` of each row of ``pred`` [P, N] against one ``label`` [N] -> [P], in one pass (the STS
    search scores thousands of candidate parameters on the same rounds)."""
    pred, label = pred.float(), label.float().flatten()
    P, N = pred.shape
    if N == 0:
        return torch.zeros(P)
    idx = (pred * bins).long().clamp(0, bins - 1)                                   # [P, N]
    n = torch.zeros(P, bins).scatter_add_(1, idx, torch.ones_like(pred))
    gap = torch.zeros(P, bins).scatter_add_(1, idx, pred - label[None])
    keep = n >= max(1, min_count)
    used = (n * keep).sum(1)
    return torch.where(used > 0, (gap.abs() * keep).sum(1) / used.clamp(min=1), torch.zeros(P))


def _ece_of_pairs(g: torch.Tensor, prefix: torch.Tensor, label: torch.Tensor, pairs: list[tuple[float, float]],
                  cfg: STSConfig, chunk_elems: int = 1 << 22) -> list[float]:
    """ECE of ``prefix * sigmoid(g / t + b)`` against ``label`` for every (t, b) in ``pairs``, in chunks of
    about ``chunk_elems`` predictions."""
    t = torch.tensor([p[0] for p in pairs])
    b = torch.tensor([p[1] for p in pairs])
    step = max(1, chunk_elems // max(1, g.numel()))
    out: list[float] = []
    for i in range(0, len(pairs), step):
        pred = prefix[None] * torch.sigmoid(g[None] / t[i:i + step, None] + b[i:i + step, None])
        out.extend(ece_rows(pred, label, cfg.bins, cfg.min_bin_count).tolist())
    return out


def position_ece(surv: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> list[float]:
    """Per-position ECE of a survival [N, G] against prefix labels [N, G] (no floor: cheap enough to read
    live)."""
    return [round(ece(surv[:, k], labels[:, k], bins), 5) for k in range(surv.shape[1])]


@dataclass
class RefitDecision:
    """What :func:`guarded_refit` decided: the new calibration (None when refused), why, and the held-back
    slice's per-position ECE of the candidate and of the reference calibration it had to beat."""

    calibration: Calibration | None
    accepted: bool
    reason: str                      # "better" | "too_few_rounds" | "worse_than_reference"
    rounds_fit: int
    rounds_heldback: int
    ece_candidate: list[float] = field(default_factory=list)
    ece_reference: list[float] = field(default_factory=list)
    ece_active: list[float] = field(default_factory=list)    # the calibration in use, when one was given
    ece_active_floor: list[float] = field(default_factory=list)  # ... and the ECE a calibrated predictor shows there

    def to_dict(self) -> dict:
        return {"accepted": self.accepted, "reason": self.reason, "rounds_fit": self.rounds_fit,
                "rounds_heldback": self.rounds_heldback, "ece_candidate": self.ece_candidate,
                "ece_reference": self.ece_reference, "ece_active": self.ece_active,
                "ece_active_floor": self.ece_active_floor,
                "temperatures": self.calibration.temperatures if self.calibration else None,
                "shifts": self.calibration.shifts if self.calibration else None}


def guarded_refit(conf_logits: torch.Tensor, accepted: torch.Tensor, reference: Calibration,
                  cfg: STSConfig = STSConfig(shift=True), holdback_every: int = 4,
                  active: Calibration | None = None) -> RefitDecision:
    """Refit STS on a window of fully verified rounds, refusing a fit that does worse than ``reference``
    (the shipped calibration) on rounds it did not see.

    Every ``holdback_every``-th round (in window order) is held back; :func:`fit_sts` (``cfg``, with
    ``reference`` as its fallback) fits on the rest. The candidate is accepted only if its mean
    per-position ECE on the held-back rounds is no worse than the reference's there. Too few rounds to
    fit (``cfg.min_rounds``) is a refusal too: the reference stays. With ``active`` (the calibration in
    use), its held-back ECE is reported too (``ece_active``) with the floor a perfectly calibrated predictor
    shows on those rounds (``ece_active_floor``, :func:`ece_floor`), so a caller can tell news from noise."""
    if conf_logits.dim() != 2 or accepted.shape != conf_logits.shape[:1]:
        raise ValueError(f"conf_logits must be [N, G] and accepted [N]; got {tuple(conf_logits.shape)} and "
                         f"{tuple(accepted.shape)}")
    if holdback_every < 2:
        raise ValueError(f"holdback_every must be >= 2, got {holdback_every}")
    N, G = conf_logits.shape
    held = torch.arange(N) % holdback_every == 0
    fit_c, fit_a, held_c, held_a = conf_logits[~held], accepted[~held], conf_logits[held], accepted[held]
    n_fit, n_held = int(fit_c.shape[0]), int(held_c.shape[0])
    labels = prefix_labels(held_a, G)
    ref_ece = position_ece(reference.survival(held_c), labels, cfg.bins) if n_held else []
    act_ece, act_floor = [], []
    if n_held and active is not None:
        act_surv = active.survival(held_c)
        act_ece = position_ece(act_surv, labels, cfg.bins)
        act_floor = [round(ece_floor(act_surv[:, k], cfg.bins, draws=32), 5) for k in range(G)]
    if n_fit < cfg.min_rounds:
        return RefitDecision(None, False, "too_few_rounds", n_fit, n_held, [], ref_ece, act_ece, act_floor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cand = fit_sts(fit_c, fit_a, cfg, previous=reference)
    cand_ece = position_ece(cand.survival(held_c), labels, cfg.bins)
    better = sum(cand_ece) <= sum(ref_ece)
    return RefitDecision(cand if better else None, better, "better" if better else "worse_than_reference",
                         n_fit, n_held, cand_ece, ref_ece, act_ece, act_floor)


def crossfit_metrics(groups: list[tuple[torch.Tensor, torch.Tensor]], cfg: STSConfig = STSConfig()) -> list[dict]:
    """Out-of-sample calibration quality: each group of rounds (conf logits [n, G], accepted [n]; e.g. the rounds
    of one half of the prompts) is calibrated by STS fitted on the *other* groups' rounds, and the per-position
    metrics (:func:`position_metrics`) are those of the pooled out-of-fold survival.

    ``fit_sts``'s ``calibrated`` metrics are in-sample: measured on the rounds the temperatures were fitted on,
    and rounds of one prompt are correlated, so with few prompts they flatter the calibration a new prompt
    gets. Group by prompt to read the latter. ``cfg`` is each fold's :func:`fit_sts` setting (a fold below
    its ``min_rounds`` keeps the identity, with its warning)."""
    if len(groups) < 2:
        raise ValueError(f"a cross-fit needs at least two groups of rounds, got {len(groups)}")
    G = groups[0][0].shape[1]
    survs, labels = [], []
    for i, (conf, acc) in enumerate(groups):
        rest = [g for j, g in enumerate(groups) if j != i]
        cal = fit_sts(torch.cat([c for c, _ in rest]), torch.cat([a for _, a in rest]), cfg)
        survs.append(cal.survival(conf))
        labels.append(prefix_labels(acc, G))
    return position_metrics(torch.cat(survs), torch.cat(labels), cfg.bins)


def reliability_plot(conf_logits: torch.Tensor, accepted: torch.Tensor, cal: Calibration, path, bins: int = 10,
                     positions: tuple[int, ...] = (1, 3, 5, 7)) -> None:
    """Reliability diagrams (raw vs calibrated survival) for some positions, written as a PNG."""
    import matplotlib                               # imported here: seconds of start-up, for plots only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    G = conf_logits.shape[1]
    labels = prefix_labels(accepted, G)
    raw, calib = survival(conf_logits), cal.survival(conf_logits)
    pos = [p for p in positions if p <= G] or [1]
    fig, axes = plt.subplots(1, len(pos), figsize=(3.6 * len(pos), 3.4), squeeze=False)
    for ax, p in zip(axes[0], pos):
        for name, s in (("raw", raw), ("STS", calib)):
            pred, y = s[:, p - 1], labels[:, p - 1]
            idx = (pred * bins).long().clamp(0, bins - 1)
            xs, ys = [], []
            for b in range(bins):
                m = idx == b
                if int(m.sum()) >= 5:
                    xs.append(float(pred[m].mean()))
                    ys.append(float(y[m].mean()))
            ax.plot(xs, ys, marker="o", label=f"{name} (ECE {ece(pred, y):.3f})")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_title(f"position {p}")
        ax.set_xlabel("predicted survival")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("observed prefix acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
