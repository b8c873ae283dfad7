"""`python -m jaxreshard.bench_multihost`: runs `jaxreshard.tools.bench_multihost`."""

if __name__ == "__main__":
    from jaxreshard.tools.bench_multihost import main

    main()
