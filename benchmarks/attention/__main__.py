from benchmarks.attention.cli import main

main()
