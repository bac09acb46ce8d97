"""Brute-force pipeline partitioner: every contiguous split, costed from the stated model.

Independent of ``virtualflow.plan.pipeline.partition``: it enumerates all ``C(L-1, p-1)`` cut
sets and costs each stage directly from the layers, with the cost model written out again:

- time(stage [a, b)) = sum over its layers of forward_s + backward_s, plus, unless it is the last
  stage, 2 * (activation_bytes of layer b-1 / bandwidth + latency);
- memory(stage s) = factor * sum(param_bytes) + in_flight[s] * sum(stash_bytes), in_flight
  defaulting to p - s;
- feasible when every stage's memory <= limit.
"""

from __future__ import annotations

from itertools import combinations, product


def stage_costs(layers, cuts, *, bandwidth, latency, factor=4.0, in_flight=None):
    n, p = len(layers), len(cuts) + 1
    in_flight = [p - s for s in range(p)] if in_flight is None else list(in_flight)
    edges = [0, *cuts, n]
    times, mems = [], []
    for s in range(p):
        a, b = edges[s], edges[s + 1]
        t = sum(l.forward_s + l.backward_s for l in layers[a:b])
        if s < p - 1:
            t += 2 * (layers[b - 1].activation_bytes / bandwidth + latency)
        times.append(t)
        mems.append(factor * sum(l.param_bytes for l in layers[a:b])
                    + in_flight[s] * sum(l.stash_bytes for l in layers[a:b]))
    return times, mems


def all_splits(layers, stages, *, bandwidth, latency, factor=4.0, in_flight=None, limit=None):
    """Every feasible split as ``(bottleneck, cuts, times, mems)``, cuts in lexicographic order."""
    out = []
    for cuts in combinations(range(1, len(layers)), stages - 1):
        times, mems = stage_costs(layers, cuts, bandwidth=bandwidth, latency=latency,
                                  factor=factor, in_flight=in_flight)
        if limit is not None and max(mems) > limit:
            continue
        out.append((max(times), cuts, times, mems))
    return out


def best_split(layers, stages, **kw):
    """``(bottleneck, cuts)`` of the optimum, lexicographically smallest cuts among exact ties;
    ``None`` when no split is feasible."""
    splits = all_splits(layers, stages, **kw)
    if not splits:
        return None
    opt = min(s[0] for s in splits)
    return opt, next(s[1] for s in splits if s[0] == opt)


def min_peak_memory(layers, stages, *, factor=4.0, in_flight=None):
    """Smallest ``max(stage memory)`` over all splits (time ignored)."""
    return min(max(m) for _, _, _, m in all_splits(layers, stages, bandwidth=1.0, latency=0.0,
                                                      factor=factor, in_flight=in_flight))


def best_replicated_split(layers, stages, workers, *, bandwidth, latency, factor=4.0, in_flight=None,
                          limit=None, micro_batches=1):
    """PipeDream stage replication by enumeration: every split and every replica tuple with
    ``r_s >= 1, sum(r_s) <= workers``. Stage time ``(compute + comm) / r + ring(r) / m`` with
    ``ring(r) = 2 (r-1)/r * sum(param_bytes) / bandwidth + 2 (r-1) * latency``. Returns
    ``(bottleneck, cuts, replicas)``, ties to the smallest ``(end_0, r_0, end_1, r_1, ...)``, or
    ``None``."""
    n = len(layers)
    found = []
    splits = all_splits(layers, stages, bandwidth=bandwidth, latency=latency, factor=factor,
                        in_flight=in_flight, limit=limit)
    for _, cuts, times, _ in splits:
        edges = [0, *cuts, n]
        for reps in product(range(1, workers + 1), repeat=stages):
            if sum(reps) > workers:
                continue
            stage_t = []
            for s, r in enumerate(reps):
                g = sum(l.param_bytes for l in layers[edges[s]:edges[s + 1]])
                ring = 0.0 if r == 1 else (2 * (r - 1) / r * g / bandwidth + 2 * (r - 1) * latency)
                stage_t.append(times[s] / r + ring / micro_batches)
            key = tuple(x for s in range(stages) for x in (edges[s + 1], reps[s]))
            found.append((max(stage_t), key, cuts, reps))
    if not found:
        return None
    opt = min(f[0] for f in found)
    _, _, cuts, reps = min((f for f in found if f[0] == opt), key=lambda f: f[1])
    return opt, cuts, reps
