"""A worked example of attention, small enough to check by hand: one head, three tokens,
d_h = 3."""

import numpy as np

from dsattn.attention.common import causal_mask, masked_softmax


def test_worked_example():
    # K and V as rows (one per token):
    K = np.array([[2, 0, 1], [1, 1, 0], [1, 2, 1]], float)
    V = np.array([[0, 1, 1], [1, 0, 1], [1, 2, 0]], float)
    q3 = np.array([2, 1, 0], float)
    scores = K @ q3 / np.sqrt(3)
    np.testing.assert_allclose(scores, [2.309, 1.732, 2.309], atol=5e-4)

    # The library's masked softmax over the same scores: token 3 sees all three tokens.
    pos = np.arange(3)[None]
    weights = np.asarray(masked_softmax(scores[None, None, None, :],
                                        causal_mask(pos[:, 2:], pos)))[0, 0, 0]
    np.testing.assert_allclose(weights, [0.390, 0.219, 0.390], atol=5e-4)
    np.testing.assert_allclose(weights @ V, [0.610, 1.171, 0.610], atol=1e-3)


def test_masked_softmax_hides_future_and_handles_empty_rows():
    s = np.zeros((1, 1, 2, 3))
    pos_q = np.array([[0, -1]])  # the second query sees nothing
    w = np.asarray(masked_softmax(s, causal_mask(pos_q, np.arange(3)[None])))
    np.testing.assert_allclose(w[0, 0, 0], [1, 0, 0])
    np.testing.assert_allclose(w[0, 0, 1], [0, 0, 0])
