"""brokerha.broker"""
