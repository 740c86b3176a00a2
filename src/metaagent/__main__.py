from metaagent.cli import main

main()
