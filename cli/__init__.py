"""The ``gdskv`` command line (mapped into the package as ``gdskv.cli``)."""
