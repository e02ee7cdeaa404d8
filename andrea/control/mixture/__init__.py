"""The data mixture: the operator's policy, the bandit, the data proxy and the policy pivot."""
