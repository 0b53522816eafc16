"""brokerha.cluster"""
