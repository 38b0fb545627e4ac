package main

import "syscall"

// childAttr makes a child (server or publisher) die with this process.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
