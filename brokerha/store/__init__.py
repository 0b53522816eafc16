"""brokerha.store"""
