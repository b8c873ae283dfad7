"""`python -m jaxreshard.bench`: runs `jaxreshard.tools.bench` (a short command)."""

if __name__ == "__main__":
    from jaxreshard.tools.bench import main

    main()
