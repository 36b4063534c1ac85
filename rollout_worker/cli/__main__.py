from rollout_worker.cli.main import main

main()
