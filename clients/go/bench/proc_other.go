//go:build !linux

package main

import "syscall"

// childAttr: no parent-death signal outside Linux; the servers are killed on
// exit and on an interrupt.
func childAttr() *syscall.SysProcAttr { return nil }
