"""`python -m jaxreshard.simulate`: runs `jaxreshard.tools.simulate` (kept here so the command
stays short)."""

if __name__ == "__main__":
    import sys

    from jaxreshard.tools.simulate import main

    sys.exit(main())
