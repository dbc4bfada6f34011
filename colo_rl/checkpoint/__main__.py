from colo_rl.checkpoint.export import main

main()
