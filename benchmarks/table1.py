"""DeDLOC Table 1 (ResNet-50 averaging time) from the planner's time model.

    python benchmarks/table1.py        # < 2 s

The paper's setups (section 4.1): A = 8 peers (V100) at 1 Gb/s; B = 16 peers (1080 Ti) at
200 Mb/s; C = A + B; D = B + one 2.5 Gb/s peer without a GPU. Links symmetric, every peer
reachable, every GPU peer computes (pinned: the table times averaging over all of them),
ResNet-50 = 25.6M parameters sent as fp32 (issue 3). Table 1 times averaging alone, so compute
is set high enough never to bind. For each setup we print seconds per averaging round for the
LP plan (``solve_plan``), butterfly all-reduce over the GPU peers and the best single parameter
server, next to the paper's measurements; the last line is JSON
``{"A": {"allreduce_s", "ps_s", "plan_s", "fp16": {...}, "paper": {...}}, ...}``.

Where our numbers differ from the paper's, and why:

* Ours are bandwidth lower bounds (``predict_round_s``: the busiest link, perfectly pipelined);
  the paper measured real rounds with latency, TCP and protocol overhead.
* Yet three measurements are *below* the fp32 bound: A's all-reduce (1.19 s; moving 1.75 x
  102 MB through 1 Gb/s takes 1.43 s), C's plan (2.96 s; every 200 Mb/s peer must send its
  gradient and fetch the parameters, 102 MB each way, 4.10 s) and D's parameter server (3.22 s;
  16 x 102 MB into 2.5 Gb/s takes 5.24 s). Those runs must have sent fewer than 4 bytes per
  parameter (e.g. float16 transport) or had faster links than nominal. With 2 bytes/param (the
  "fp16" lines) every prediction is below its measurement by 1.2-1.7x, the overhead of a real
  round.
* The strategies rank as in the paper: the plan equals all-reduce on A and B, beats all-reduce
  on C by 1.92x (measured: 1.92x) and beats the parameter server on D, by 13% in the bound
  against 1% measured.
"""

from __future__ import annotations

import json

from relay_server.planning.planner import solve_plan
from relay_server.planning.problem import PeerCapacity
from relay_server.planning.round_time import allreduce_round_s, parameter_server_round_s

PARAMS = 25_600_000  # ResNet-50
GBIT = 1e9 / 8  # bytes/s per Gb/s
ALWAYS = 1e9  # samples/s: compute never binds, so the plan is the fastest averaging
PAPER = {  # Table 1: seconds per averaging round (AR, PS, Ours)
    "A": {"allreduce_s": 1.19, "ps_s": 4.73, "plan_s": 1.20},
    "B": {"allreduce_s": 5.3, "ps_s": 39.6, "plan_s": 5.3},
    "C": {"allreduce_s": 5.69, "ps_s": 14.1, "plan_s": 2.96},
    "D": {"allreduce_s": 5.3, "ps_s": 3.22, "plan_s": 3.18},
}


def _gpus(prefix: str, count: int, gbit: float) -> list[PeerCapacity]:
    return [PeerCapacity(f"{prefix}{i:02d}", ALWAYS, gbit * GBIT, gbit * GBIT, True, True) for i in range(count)]


def setups() -> dict[str, list[PeerCapacity]]:
    a, b = _gpus("v100-", 8, 1.0), _gpus("1080ti-", 16, 0.2)
    aux = PeerCapacity("cpu-aux", 0.0, 2.5 * GBIT, 2.5 * GBIT, True)
    return {"A": a, "B": b, "C": a + b, "D": b + [aux]}


def predict(peers: list[PeerCapacity], bytes_per_param: float) -> dict[str, float]:
    """Seconds per averaging round for the three strategies."""
    plan = solve_plan(peers, PARAMS, target_batch=1.0, bytes_per_param=bytes_per_param)
    return {
        "allreduce_s": allreduce_round_s(peers, PARAMS, bytes_per_param),
        "ps_s": parameter_server_round_s(peers, PARAMS, bytes_per_param)[1],
        "plan_s": plan.predicted_round_s,
    }


def main() -> None:
    out = {}
    print(f"{'setup':6}{'':12}{'AR s':>8}{'PS s':>8}{'plan s':>8}")
    for name, peers in setups().items():
        fp32, fp16 = predict(peers, 4.0), predict(peers, 2.0)
        for label, row in (("ours fp32", fp32), ("ours fp16", fp16), ("paper", PAPER[name])):
            print(f"{name:6}{label:12}{row['allreduce_s']:8.2f}{row['ps_s']:8.2f}{row['plan_s']:8.2f}")
        out[name] = {
            **{k: round(v, 3) for k, v in fp32.items()},
            "fp16": {k: round(v, 3) for k, v in fp16.items()},
            "paper": PAPER[name],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
