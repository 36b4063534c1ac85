module rollout.local/pause

go 1.22
