package main

import (
	"context"

	cadvisorapi "github.com/google/cadvisor/info/v1"
	cadvisorapiv2 "github.com/google/cadvisor/info/v2"
	cadvisortest "k8s.io/kubernetes/pkg/kubelet/cadvisor/testing"
)

// machine is kubemark's fake cAdvisor with the size a node is given: a
// zero field keeps kubemark's (1 core, 3.75 GB, no disk). A host node
// needs a disk: virt-launcher pods request ephemeral storage, which a node
// without any can never take.
type machine struct {
	*cadvisortest.Fake
	cores  int
	memory uint64
	disk   uint64
}

func (m *machine) MachineInfo() (*cadvisorapi.MachineInfo, error) {
	info, err := m.Fake.MachineInfo()
	if err != nil {
		return nil, err
	}
	if m.cores > 0 {
		info.NumCores = m.cores
	}
	if m.memory > 0 {
		info.MemoryCapacity = m.memory
	}
	return info, nil
}

func (m *machine) fs() cadvisorapiv2.FsInfo {
	if m.disk == 0 {
		return cadvisorapiv2.FsInfo{}
	}
	// Always empty: the containers write nothing to it.
	return cadvisorapiv2.FsInfo{Capacity: m.disk, Available: m.disk}
}

func (m *machine) RootFsInfo() (cadvisorapiv2.FsInfo, error) { return m.fs(), nil }

func (m *machine) ImagesFsInfo(context.Context) (cadvisorapiv2.FsInfo, error) { return m.fs(), nil }

func (m *machine) ContainerFsInfo(context.Context) (cadvisorapiv2.FsInfo, error) { return m.fs(), nil }
