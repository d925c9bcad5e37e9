# pragma version 0.4.3
"""
@title GNK
@notice The reward and staking token: an ERC-20 with 9 decimals (1 GNK = 10**9 ngonka, as on the
        Gonka chain). Only the minter (governance) can create tokens; the minter can hand the role on,
        e.g. from the deploying account to the Governor contract.
"""

from ethereum.ercs import IERC20

implements: IERC20

event Transfer:
    sender: indexed(address)
    receiver: indexed(address)
    value: uint256

event Approval:
    owner: indexed(address)
    spender: indexed(address)
    value: uint256

event MinterChanged:
    previous: indexed(address)
    minter: indexed(address)

name: public(constant(String[8])) = "Gonka"
symbol: public(constant(String[8])) = "GNK"
decimals: public(constant(uint8)) = 9

totalSupply: public(uint256)
balanceOf: public(HashMap[address, uint256])
allowance: public(HashMap[address, HashMap[address, uint256]])
minter: public(address)


@deploy
def __init__(minter: address):
    assert minter != empty(address), "gnk: zero minter"
    self.minter = minter
    log MinterChanged(previous=empty(address), minter=minter)


@internal
def _transfer(sender: address, receiver: address, amount: uint256):
    assert receiver != empty(address), "gnk: transfer to zero address"
    assert self.balanceOf[sender] >= amount, "gnk: insufficient balance"
    self.balanceOf[sender] -= amount
    self.balanceOf[receiver] += amount
    log Transfer(sender=sender, receiver=receiver, value=amount)


@external
def transfer(receiver: address, amount: uint256) -> bool:
    self._transfer(msg.sender, receiver, amount)
    return True


@external
def transferFrom(sender: address, receiver: address, amount: uint256) -> bool:
    allowed: uint256 = self.allowance[sender][msg.sender]
    assert allowed >= amount, "gnk: insufficient allowance"
    # An allowance of 2**256-1 is "unlimited" and is not consumed (saves an SSTORE per transfer).
    if allowed != max_value(uint256):
        self.allowance[sender][msg.sender] = allowed - amount
    self._transfer(sender, receiver, amount)
    return True


@external
def approve(spender: address, amount: uint256) -> bool:
    self.allowance[msg.sender][spender] = amount
    log Approval(owner=msg.sender, spender=spender, value=amount)
    return True


@external
def mint(receiver: address, amount: uint256):
    assert msg.sender == self.minter, "gnk: only the minter (governance) can mint"
    assert receiver != empty(address), "gnk: mint to zero address"
    self.totalSupply += amount
    self.balanceOf[receiver] += amount
    log Transfer(sender=empty(address), receiver=receiver, value=amount)


@external
def set_minter(minter: address):
    assert msg.sender == self.minter, "gnk: only the minter can hand over minting"
    assert minter != empty(address), "gnk: zero minter"
    log MinterChanged(previous=self.minter, minter=minter)
    self.minter = minter
