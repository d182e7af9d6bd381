"""Exact metrics for judging models against the data (e.g. a generator's planted model)."""
import numpy as np


def roc_auc(labels, scores):
    """Area under the ROC curve: the probability that a random positive scores above a
    random negative, ties counting one half (the Mann-Whitney statistic)."""
    positive = np.asarray(labels).ravel() > 0.5
    scores = np.asarray(scores, dtype=np.float64).ravel()
    num_pos, num_neg = int(positive.sum()), int((~positive).sum())
    if num_pos == 0 or num_neg == 0:
        raise ValueError(f"AUC needs both classes; got {num_pos} positives and {num_neg} negatives")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = ((ends - counts + 1 + ends) / 2.0)[inverse]   # ties share their average rank
    return float((ranks[positive].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))
