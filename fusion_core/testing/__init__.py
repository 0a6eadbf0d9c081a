"""Test helpers for fusion-core and family authors: tiny real models and conformance checks."""
