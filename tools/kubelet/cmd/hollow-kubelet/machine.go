package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	cadvisorapi "github.com/google/cadvisor/info/v1"
	cadvisorapiv2 "github.com/google/cadvisor/info/v2"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	cadvisortest "k8s.io/kubernetes/pkg/kubelet/cadvisor/testing"
	"k8s.io/kubernetes/pkg/kubelet/cm"
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

// sizedContainerManager reports the node's disk as its ephemeral-storage
// capacity, which the stub container manager leaves at zero.
type sizedContainerManager struct {
	cm.ContainerManager
	disk uint64
}

func (c *sizedContainerManager) GetCapacity(localStorageCapacityIsolation bool) v1.ResourceList {
	l := c.ContainerManager.GetCapacity(localStorageCapacityIsolation)
	if localStorageCapacityIsolation && c.disk > 0 {
		if l == nil {
			l = v1.ResourceList{}
		}
		l[v1.ResourceEphemeralStorage] = *resource.NewQuantity(int64(c.disk), resource.BinarySI) //nolint:gosec // a flag's size
	}
	return l
}

// deviceMap is --device NAME=COUNT, repeatable: extended resources the
// node reports as device plugins' (as virt-handler's do for KubeVirt).
type deviceMap map[string]int64

func (m deviceMap) String() string { return fmt.Sprint(map[string]int64(m)) }

func (m deviceMap) Set(v string) error {
	name, count, ok := strings.Cut(v, "=")
	n, err := strconv.ParseInt(count, 10, 64)
	if !ok || name == "" || err != nil || n < 0 {
		return fmt.Errorf("want NAME=COUNT, got %q", v)
	}
	m[name] = n
	return nil
}

func (m deviceMap) resources() v1.ResourceList {
	l := v1.ResourceList{}
	for name, n := range m {
		l[v1.ResourceName(name)] = *resource.NewQuantity(n, resource.DecimalSI)
	}
	return l
}
