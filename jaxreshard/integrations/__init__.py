"""Adapters that route other frameworks' weight sync through jaxreshard.

Each adapter imports its framework only when it is used: ``import jaxreshard`` never imports
one.
"""
