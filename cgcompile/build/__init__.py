"""Compile time: one Dynamo graph becomes pieces, their runners and a runtime (`phases`, `compiler`)."""
