// Package nodeid works out which KubeVirt VM this guest node is, the node ID
// the controller hot-plugs disks into. It matches the node's MAC addresses
// against the host cluster's VirtualMachineInstances, as upstream does.
package nodeid

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Ignored MACs: Calico gives every workload interface ee:ee:ee:ee:ee:ee, so it
// matches every VM (harvester 6981); loopback and some virtual links report
// all zeros.
const (
	calicoMAC = "ee:ee:ee:ee:ee:ee"
	zeroMAC   = "00:00:00:00:00:00"
)

// VMI is the part of a VirtualMachineInstance discovery needs.
type VMI struct {
	Name string
	MACs []string
}

// VMISource looks up VMIs in the host namespace holding the guest's VMs.
type VMISource interface {
	// GetVMI returns the named VMI, or nil and no error when there is none.
	GetVMI(ctx context.Context, name string) (*VMI, error)
	// ListVMIs returns all VMIs of the host namespace.
	ListVMIs(ctx context.Context) ([]VMI, error)
}

// FromKubeVirt extracts the MAC addresses of a KubeVirt VMI, from its status
// (what the guest agent reports) and its spec (fixed addresses).
func FromKubeVirt(vmi *kubevirtv1.VirtualMachineInstance) VMI {
	out := VMI{Name: vmi.Name}
	for _, i := range vmi.Status.Interfaces {
		if i.MAC != "" {
			out.MACs = append(out.MACs, i.MAC)
		}
	}
	for _, i := range vmi.Spec.Domain.Devices.Interfaces {
		if i.MacAddress != "" {
			out.MACs = append(out.MACs, i.MacAddress)
		}
	}
	return out
}

// Options configures discovery.
type Options struct {
	// SysfsRoot is where sysfs is mounted (required; the node service passes
	// device.DefaultSysfsRoot); MACs are read from
	// <SysfsRoot>/class/net/*/address.
	SysfsRoot string
	// Hostname is the node's hostname (default os.Hostname()).
	Hostname string
	// VMIs is the host view; nil means the hostname is the answer.
	VMIs VMISource
}

// Discover returns the VM name of this node: the VMI named after the hostname
// if one of its MACs is ours, else the first VMI (by name) with one of our
// MACs, else the hostname. Errors of the host API are returned rather than
// answered with the hostname, because a wrong node ID sticks in CSINode.
func Discover(ctx context.Context, o Options) (string, error) {
	logger := klog.FromContext(ctx)
	host := o.Hostname
	if host == "" {
		h, err := os.Hostname()
		if err != nil {
			return "", fmt.Errorf("hostname: %w", err)
		}
		host = h
	}
	if o.VMIs == nil {
		logger.Info("no host cluster access for node ID discovery; using the hostname", "vm", host)
		return host, nil
	}
	macs, err := LocalMACs(o.SysfsRoot)
	if err != nil {
		return "", err
	}
	if len(macs) == 0 {
		logger.Info("no usable MAC address on this node; using the hostname", "vm", host)
		return host, nil
	}
	vmi, err := o.VMIs.GetVMI(ctx, host)
	if err != nil {
		return "", fmt.Errorf("get VMI %q: %w", host, err)
	}
	if vmi != nil && sharesMAC(macs, vmi.MACs) {
		logger.V(2).Info("node ID from the VMI named after the hostname", "vm", vmi.Name)
		return vmi.Name, nil
	}
	vmis, err := o.VMIs.ListVMIs(ctx)
	if err != nil {
		return "", fmt.Errorf("list VMIs: %w", err)
	}
	sort.Slice(vmis, func(i, j int) bool { return vmis[i].Name < vmis[j].Name })
	for _, v := range vmis {
		if sharesMAC(macs, v.MACs) {
			logger.Info("node ID from the VMI with this node's MAC", "vm", v.Name, "hostname", host)
			return v.Name, nil
		}
	}
	logger.Info("no VMI has this node's MAC addresses; using the hostname", "vm", host, "macs", macs)
	return host, nil
}

// LocalMACs returns the node's usable MAC addresses, normalised to lower case
// with colons, sorted and without duplicates.
func LocalMACs(sysfsRoot string) ([]string, error) {
	if sysfsRoot == "" {
		// The caller owns the default (device.DefaultSysfsRoot); a relative
		// "class/net" would read whatever the working directory holds.
		return nil, fmt.Errorf("no sysfs root given")
	}
	dir := filepath.Join(sysfsRoot, "class", "net")
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", dir, err)
	}
	seen := map[string]bool{}
	var out []string
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dir, e.Name(), "address"))
		if err != nil {
			// Not every entry has an address, and some virtual links refuse
			// to report one (EINVAL): neither can identify the VM.
			continue
		}
		mac := normalize(string(b))
		if mac == "" || mac == calicoMAC || mac == zeroMAC || seen[mac] {
			continue
		}
		seen[mac] = true
		out = append(out, mac)
	}
	sort.Strings(out)
	return out, nil
}

func normalize(mac string) string {
	return strings.ReplaceAll(strings.ToLower(strings.TrimSpace(mac)), "-", ":")
}

func sharesMAC(local, vmi []string) bool {
	for _, m := range vmi {
		n := normalize(m)
		if n == calicoMAC || n == zeroMAC {
			continue
		}
		for _, l := range local {
			if l == n {
				return true
			}
		}
	}
	return false
}

// KubeVirtVMIs is the part of a typed KubeVirt VMI client (for example
// KubevirtV1().VirtualMachineInstances(hostNamespace)) discovery uses.
type KubeVirtVMIs interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions) (*kubevirtv1.VirtualMachineInstance, error)
	List(ctx context.Context, opts metav1.ListOptions) (*kubevirtv1.VirtualMachineInstanceList, error)
}

// KubeVirtSource adapts a typed VMI client to VMISource.
func KubeVirtSource(vmis KubeVirtVMIs) VMISource { return kubeVirtSource{vmis} }

type kubeVirtSource struct{ c KubeVirtVMIs }

func (s kubeVirtSource) GetVMI(ctx context.Context, name string) (*VMI, error) {
	vmi, err := s.c.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	v := FromKubeVirt(vmi)
	return &v, nil
}

func (s kubeVirtSource) ListVMIs(ctx context.Context) ([]VMI, error) {
	list, err := s.c.List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	out := make([]VMI, 0, len(list.Items))
	for i := range list.Items {
		out = append(out, FromKubeVirt(&list.Items[i]))
	}
	return out, nil
}
