"""The paper's synthetic studies (§4.1, Figs. 1, 2, 4–6): the estimator's error against
the exact WNG, the bandwidth, the W2 flow; book chapter :ref:`experiments-synthetic`."""
