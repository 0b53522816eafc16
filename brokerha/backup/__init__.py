"""brokerha.backup"""
