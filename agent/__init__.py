"""The agent runtime both daemons use: environments, tools, sandbox, inference, rollout,
model loading and evaluation."""
