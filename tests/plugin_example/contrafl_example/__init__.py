"""An example contrafl plugin (docs/extending.md): the FedLC algorithm, a generated
``blobs`` dataset and a residual MLP backbone, registered through the entry points of
its pyproject.toml."""
