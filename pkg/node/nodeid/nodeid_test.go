package nodeid

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/klog/v2/ktesting"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

type fixture struct {
	vmis    []VMI
	getErr  error
	listErr error
}

func (f fixture) GetVMI(_ context.Context, name string) (*VMI, error) {
	if f.getErr != nil {
		return nil, f.getErr
	}
	for i := range f.vmis {
		if f.vmis[i].Name == name {
			return &f.vmis[i], nil
		}
	}
	return nil, nil
}

func (f fixture) ListVMIs(context.Context) ([]VMI, error) { return f.vmis, f.listErr }

func sysfs(t *testing.T, ifaces map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for name, mac := range ifaces {
		dir := filepath.Join(root, "class", "net", name)
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
		if mac == "" {
			continue // an interface without address file
		}
		if err := os.WriteFile(filepath.Join(dir, "address"), []byte(mac+"\n"), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestLocalMACs(t *testing.T) {
	root := sysfs(t, map[string]string{
		"lo": "00:00:00:00:00:00", "cali0": "ee:ee:ee:ee:ee:ee", "eth0": "52:54:00:12:34:56",
		"eth1": "52:54:00:AB:CD:EF", "bond0": "52:54:00:12:34:56", "sit0": "",
	})
	got, err := LocalMACs(root)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"52:54:00:12:34:56", "52:54:00:ab:cd:ef"}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("got %v, want %v", got, want)
	}
	if _, err := LocalMACs(t.TempDir()); err == nil {
		t.Fatal("missing class/net should be an error")
	}
}

func TestDiscover(t *testing.T) {
	root := sysfs(t, map[string]string{"lo": "00:00:00:00:00:00", "cali0": "ee:ee:ee:ee:ee:ee", "eth0": "52:54:00:12:34:56"})
	mine := []string{"52:54:00:12:34:56"}
	calico := []string{"ee:ee:ee:ee:ee:ee"}
	apiDown := errors.New("connection refused")
	for _, tc := range []struct {
		name    string
		src     VMISource
		want    string
		wantErr bool
	}{
		{name: "no host access", src: nil, want: "host-1"},
		{name: "VMI named after the hostname", src: fixture{vmis: []VMI{{Name: "a", MACs: mine}, {Name: "host-1", MACs: mine}}}, want: "host-1"},
		{name: "hostname VMI with other MACs, MAC match elsewhere", src: fixture{vmis: []VMI{{Name: "host-1", MACs: []string{"52:54:00:00:00:01"}}, {Name: "vm-z", MACs: mine}, {Name: "vm-b", MACs: []string{"52-54-00-12-34-56"}}}}, want: "vm-b"},
		{name: "only Calico's MAC in common", src: fixture{vmis: []VMI{{Name: "vm-a", MACs: calico}}}, want: "host-1"},
		{name: "no match", src: fixture{vmis: []VMI{{Name: "vm-a", MACs: []string{"52:54:00:00:00:02"}}}}, want: "host-1"},
		{name: "get fails", src: fixture{getErr: apiDown}, wantErr: true},
		{name: "list fails", src: fixture{listErr: apiDown}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			got, err := Discover(ctx, Options{SysfsRoot: root, Hostname: "host-1", VMIs: tc.src})
			if tc.wantErr {
				if err == nil {
					t.Fatalf("want error, got %q", got)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

func TestDiscoverWithoutUsableMACs(t *testing.T) {
	root := sysfs(t, map[string]string{"lo": "00:00:00:00:00:00"})
	_, ctx := ktesting.NewTestContext(t)
	got, err := Discover(ctx, Options{SysfsRoot: root, Hostname: "h", VMIs: fixture{vmis: []VMI{{Name: "x", MACs: []string{"00:00:00:00:00:00"}}}}})
	if err != nil || got != "h" {
		t.Fatalf("got %q, %v", got, err)
	}
}

func TestFromKubeVirt(t *testing.T) {
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "vm-1"}}
	vmi.Status.Interfaces = []kubevirtv1.VirtualMachineInstanceNetworkInterface{{MAC: "52:54:00:00:00:01"}, {}}
	vmi.Spec.Domain.Devices.Interfaces = []kubevirtv1.Interface{{MacAddress: "52:54:00:00:00:02"}}
	got := FromKubeVirt(vmi)
	if got.Name != "vm-1" || len(got.MACs) != 2 {
		t.Fatalf("got %+v", got)
	}
}

type typedVMIs struct {
	items []kubevirtv1.VirtualMachineInstance
}

func (f typedVMIs) Get(_ context.Context, name string, _ metav1.GetOptions) (*kubevirtv1.VirtualMachineInstance, error) {
	for i := range f.items {
		if f.items[i].Name == name {
			return &f.items[i], nil
		}
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Group: "kubevirt.io", Resource: "virtualmachineinstances"}, name)
}

func (f typedVMIs) List(context.Context, metav1.ListOptions) (*kubevirtv1.VirtualMachineInstanceList, error) {
	return &kubevirtv1.VirtualMachineInstanceList{Items: f.items}, nil
}

func TestKubeVirtSource(t *testing.T) {
	root := sysfs(t, map[string]string{"eth0": "52:54:00:12:34:56"})
	vmi := kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "guest-1"}}
	vmi.Status.Interfaces = []kubevirtv1.VirtualMachineInstanceNetworkInterface{{MAC: "52:54:00:12:34:56"}}
	_, ctx := ktesting.NewTestContext(t)
	// The hostname's VMI does not exist (NotFound is not an error); the list finds the VM.
	got, err := Discover(ctx, Options{SysfsRoot: root, Hostname: "node-1", VMIs: KubeVirtSource(typedVMIs{items: []kubevirtv1.VirtualMachineInstance{vmi}})})
	if err != nil || got != "guest-1" {
		t.Fatalf("got %q, %v", got, err)
	}
}
