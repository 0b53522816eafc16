"""brokerha.primary"""
