"""Telemetry for pushkv: span schema, tracer set-up, exporters, reading traces back.

Library code imports only the OpenTelemetry API and ``telemetry.schema``; process entry
points set up the SDK. Nothing here is imported by the connector at module level.
"""
