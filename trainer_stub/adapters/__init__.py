"""Adapters from the service's groups to the trainers RL teams use: TRL's `rollout_func`
(`trl.py`), verl's agent loop (`verl.py`), SkyRL's generator (`skyrl.py`) and slime's rollout
function (`slime.py`). Each imports its trainer's library only when used; all read the same
`TrainingSample`s (`samples.py`), made from `RolloutClient.sampled_groups`."""
