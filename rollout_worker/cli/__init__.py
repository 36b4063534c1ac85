"""The top layer: the `rollout` command, the one-shot local stack, reports and plots, the
scripted policy server. Worker processes never import this package."""
