"""Server optimisers (Reddi et al. 2021) against hand-computed steps, and their state."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedciuic.aggregator.server_optim import (
    OptimizerState,
    OptimizerStateError,
    ServerOptimizer,
)
from fedciuic.compression import layout_of
from fedciuic.config import OptimizerName, ServerSettings

X0 = {"a": np.array([1.0, -2.0], np.float32), "b": np.array([[0.5]], np.float32)}
DELTAS = [np.array(d, np.float32) for d in ([1.0, 2.0, -1.0], [-1.0, 0.5, 0.01], [0.5, 0.5, 3.0])]


def run(name: OptimizerName, lr: float = 0.1, **changes: float) -> ServerSettings:
    values = {"momentum": 0.9, "beta2": 0.99, "epsilon": 1e-3, **changes}
    return ServerSettings(
        server_optimizer=name,
        server_learning_rate=lr,
        server_momentum=values["momentum"],
        server_beta2=values["beta2"],
        server_epsilon=values["epsilon"],
    )


def steps(opt: ServerOptimizer, count: int = 3) -> list[np.ndarray]:
    x, out = X0, []
    for delta in DELTAS[:count]:
        x = opt.step(x, delta)
        out.append(np.concatenate([x["a"].ravel(), x["b"].ravel()]))
        assert x["b"].shape == (1, 1) and x["a"].dtype == np.float32
    return out


def test_none_adds_the_delta_times_the_learning_rate():
    opt = ServerOptimizer(run("none", lr=0.5))
    x = opt.step(X0, DELTAS[0])
    np.testing.assert_allclose(x["a"], [1.5, -1.0])
    np.testing.assert_allclose(x["b"], [[0.0]])
    # bit for bit what averaging did before server optimisers: x + lr * delta in float32
    old = {
        "a": (X0["a"] + 0.5 * DELTAS[0][:2]).astype(np.float32),
        "b": (X0["b"] + 0.5 * DELTAS[0][2:].reshape(1, 1)).astype(np.float32),
    }
    assert all(x[k].tobytes() == old[k].tobytes() for k in X0)
    assert opt.state().arrays == {} and opt.steps == 1


def test_fedavgm_by_hand():
    got = steps(ServerOptimizer(run("fedavgm", lr=0.5)))
    # m1 = d1 = [1, 2, -1]; x1 = x0 + 0.5 m1
    # m2 = 0.9 m1 + d2 = [-0.1, 2.3, -0.89]; x2 = x1 + 0.5 m2
    # m3 = 0.9 m2 + d3 = [0.41, 2.57, 2.199]; x3 = x2 + 0.5 m3
    np.testing.assert_allclose(got[0], [1.5, -1.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(got[1], [1.45, 0.15, -0.445], rtol=1e-6)
    np.testing.assert_allclose(got[2], [1.655, 1.435, 0.6545], rtol=1e-6)


def reference(kind: str, lr=0.1, b1=0.9, b2=0.99, tau=1e-3) -> list[list[float]]:
    """Algorithm 2 of Reddi et al., one coordinate at a time in float64."""
    x = [1.0, -2.0, 0.5]
    m, v = [0.0] * 3, [tau**2] * 3
    out = []
    for delta in DELTAS:
        for i, d in enumerate(delta.tolist()):
            m[i] = b1 * m[i] + (1 - b1) * d
            if kind == "fedadam":
                v[i] = b2 * v[i] + (1 - b2) * d * d
            else:
                v[i] = v[i] - (1 - b2) * d * d * math.copysign(1.0, v[i] - d * d)
            x[i] += lr * m[i] / (math.sqrt(v[i]) + tau)
        out.append(list(x))
    return out


@pytest.mark.parametrize("kind", ["fedadam", "fedyogi"])
def test_adaptive_optimisers_by_hand(kind):
    got = steps(ServerOptimizer(run(kind)))
    for mine, ref in zip(got, reference(kind), strict=True):
        np.testing.assert_allclose(mine, ref, rtol=1e-5)
    # Step 1 by hand, first coordinate (d = 1): m = 0.1, v = 0.99e-6 + 0.01 (adam) or
    # 1e-6 + 0.01 (yogi: v < d^2, so v grows by (1 - b2) d^2).
    v1 = 0.99e-6 + 0.01 if kind == "fedadam" else 1e-6 + 0.01
    assert got[0][0] == pytest.approx(1.0 + 0.1 * 0.1 / (math.sqrt(v1) + 1e-3), rel=1e-6)


def test_adam_and_yogi_differ_once_the_delta_shrinks():
    adam, yogi = reference("fedadam"), reference("fedyogi")
    assert abs(adam[1][2] - yogi[1][2]) > 1e-4  # d = 0.01 after d = -1: v decays (adam) or not
    got = steps(ServerOptimizer(run("fedyogi")), 2)
    np.testing.assert_allclose(got[1], yogi[1], rtol=1e-5)
    assert abs(got[1][2] - adam[1][2]) > 1e-4


@pytest.mark.parametrize("kind", ["none", "fedavgm", "fedadam", "fedyogi"])
def test_state_round_trips_and_the_run_continues_bit_for_bit(kind):
    whole = ServerOptimizer(run(kind))
    expected = steps(whole)[-1]
    cut = ServerOptimizer(run(kind))
    x = X0
    for delta in DELTAS[:2]:
        x = cut.step(x, delta)
    state = cut.state()
    assert state.steps == 2 and state.size == 3
    assert sorted(state.arrays) == {"none": [], "fedavgm": ["m"]}.get(kind, ["m", "v"])
    resumed = ServerOptimizer.from_state(run(kind), state, layout_of(X0))
    last = resumed.step(x, DELTAS[2])
    assert np.concatenate([last["a"], last["b"].ravel()]).tobytes() == expected.tobytes()
    assert resumed.steps == 3
    if kind in ("fedavgm", "fedadam"):  # a fresh state would not have ended there
        fresh = ServerOptimizer(run(kind)).step(x, DELTAS[2])
        assert not np.array_equal(fresh["a"], last["a"])


def test_a_state_of_another_optimizer_or_adapter_is_refused():
    opt = ServerOptimizer(run("fedadam"))
    opt.step(X0, DELTAS[0])
    state = opt.state()
    with pytest.raises(OptimizerStateError, match='run config:server-optimizer: "fedyogi"'):
        ServerOptimizer.from_state(run("fedyogi"), state, layout_of(X0))
    bigger = {**X0, "c": np.zeros(4, np.float32)}
    with pytest.raises(OptimizerStateError, match="does not fit this adapter"):
        ServerOptimizer.from_state(run("fedadam"), state, layout_of(bigger))
    short = OptimizerState(**{**state.__dict__, "arrays": {"m": np.zeros(2, np.float32)}})
    with pytest.raises(OptimizerStateError, match=r"moments \['m'\], expected \['m', 'v'\]"):
        ServerOptimizer.from_state(run("fedadam"), short, layout_of(X0))
    wrong = OptimizerState(
        **{**state.__dict__, "arrays": {"m": np.zeros(2, np.float32), "v": state.arrays["v"]}}
    )
    with pytest.raises(OptimizerStateError, match=r"m is float32\[2\]"):
        ServerOptimizer.from_state(run("fedadam"), wrong, layout_of(X0))
    with pytest.raises(OptimizerStateError, match="another adapter"):
        opt.step(bigger, np.zeros(7, np.float32))


def test_moments_are_float32_and_updated_in_place():
    opt = ServerOptimizer(run("fedadam"))
    opt.step(X0, DELTAS[0])
    m, v = opt.moments["m"], opt.moments["v"]
    opt.step(X0, DELTAS[1])
    assert opt.moments["m"] is m and opt.moments["v"] is v
    assert m.dtype == v.dtype == np.float32
