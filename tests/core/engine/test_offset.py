"""A request's own confidence offset: which factors its rounds label, and what it converges to."""

import pytest
import torch

from dspark_core.engine.offset import RequestOffset


def test_a_request_offset_labels_only_the_factors_its_rounds_verified():
    half = torch.full((4,), 0.5)
    o = RequestOffset(10.0)
    assert torch.allclose(o.adjust(half), half)             # no evidence yet: the pooled probabilities
    o.update(verified=2, accepted=0)                        # a rejection at the first draft: one label, 0
    assert o.info == [10.25] and o.offset == [pytest.approx(-0.5 / 10.25)]
    o.adjust(half)
    o.update(verified=2, accepted=2)                        # both verified drafts kept: two labels, 1 and 1
    assert len(o.offset) == 2 and o.offset[1] > 0 and o.info[1] == 10.25
    o.adjust(half)
    o.update(verified=0, accepted=0)                        # nothing verified: nothing learned
    assert len(o.offset) == 2
    o.update(verified=4, accepted=4)                        # no draft sized since the last update: no-op
    assert len(o.offset) == 2
    with pytest.raises(ValueError, match="prior"):
        RequestOffset(0.0)


@pytest.mark.parametrize("true_p, verified", [(0.8, 4), (0.5, 4), (0.25, 1)])
def test_a_request_offset_learns_what_the_pooled_calibration_gets_wrong_for_one_request(true_p, verified):
    """A request whose drafts are kept with probability ``true_p`` at every step, sized with a pooled 0.5:
    its offset moves the first position toward ``true_p``; positions its rounds never verified stay put."""
    gen = torch.Generator().manual_seed(0)
    o = RequestOffset(10.0)
    for _ in range(400):
        o.adjust(torch.full((4,), 0.5))
        ok = torch.rand(verified, generator=gen) < true_p
        o.update(verified=verified, accepted=int(torch.cumprod(ok.int(), 0).sum()))
    p = o.adjust(torch.full((4,), 0.5))
    assert abs(float(p[0]) - true_p) < 0.05, (float(p[0]), true_p)
    if verified == 1:
        assert torch.allclose(p[1:], torch.full((3,), 0.5), atol=1e-5)
