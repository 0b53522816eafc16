"""brokerha.amqp"""
