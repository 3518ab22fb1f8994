package kubevirt

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

func pvcVolume(name, claim string, hot bool) kubevirtv1.Volume {
	return kubevirtv1.Volume{Name: name, VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
		PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}, Hotpluggable: hot}}}
}

// The light lists keep every field the queue's holder check reads, and the
// check sees the same objects as from a full decode, whatever else the
// objects carry.
func TestClaimReaderKeepsWhatSaysWhichClaimsAreHeld(t *testing.T) {
	vm := kubevirtv1.VirtualMachine{
		TypeMeta:   metav1.TypeMeta{APIVersion: "kubevirt.io/v1", Kind: "VirtualMachine"},
		ObjectMeta: metav1.ObjectMeta{Name: "vm-1", Namespace: "guests", Labels: map[string]string{"a": "b"}, ResourceVersion: "7"},
		Spec: kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: kubevirtv1.VirtualMachineInstanceSpec{
			Domain: kubevirtv1.DomainSpec{Devices: kubevirtv1.Devices{Disks: []kubevirtv1.Disk{{Name: "pvc-a"}}}},
			Volumes: []kubevirtv1.Volume{
				{Name: "rootdisk", VolumeSource: kubevirtv1.VolumeSource{DataVolume: &kubevirtv1.DataVolumeSource{Name: "dv-root"}}},
				pvcVolume("pvc-a", "pvc-a", true),
				{Name: "cloudinit", VolumeSource: kubevirtv1.VolumeSource{CloudInitNoCloud: &kubevirtv1.CloudInitNoCloudSource{UserData: "#cloud-config"}}},
			},
		}}},
		Status: kubevirtv1.VirtualMachineStatus{
			PrintableStatus: kubevirtv1.VirtualMachineStatusRunning,
			VolumeRequests: []kubevirtv1.VirtualMachineVolumeRequest{
				{AddVolumeOptions: &kubevirtv1.AddVolumeOptions{Name: "pvc-b", Disk: &kubevirtv1.Disk{Name: "pvc-b"},
					VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
						PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: "pvc-b"}, Hotpluggable: true}}}},
				{RemoveVolumeOptions: &kubevirtv1.RemoveVolumeOptions{Name: "pvc-a"}},
			},
		},
	}
	mode := corev1.PersistentVolumeBlock
	vmi := kubevirtv1.VirtualMachineInstance{
		TypeMeta:   metav1.TypeMeta{APIVersion: "kubevirt.io/v1", Kind: "VirtualMachineInstance"},
		ObjectMeta: metav1.ObjectMeta{Name: "vm-1", Namespace: "guests"},
		Spec:       kubevirtv1.VirtualMachineInstanceSpec{Volumes: []kubevirtv1.Volume{pvcVolume("pvc-a", "pvc-a", true)}},
		Status: kubevirtv1.VirtualMachineInstanceStatus{
			Phase: kubevirtv1.Running,
			VolumeStatus: []kubevirtv1.VolumeStatus{
				{Name: "pvc-a", Phase: kubevirtv1.VolumeReady, Target: "sda", HotplugVolume: &kubevirtv1.HotplugVolumeStatus{AttachPodName: "hp-1"},
					PersistentVolumeClaimInfo: &kubevirtv1.PersistentVolumeClaimInfo{ClaimName: "pvc-a", VolumeMode: &mode,
						Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}},
				{Name: "pvc-c", Phase: kubevirtv1.HotplugVolumeDetaching, HotplugVolume: &kubevirtv1.HotplugVolumeStatus{}},
				{Name: "rootdisk", Phase: kubevirtv1.VolumeReady},
			},
		},
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body any
		switch r.URL.Path {
		case "/apis/kubevirt.io/v1/namespaces/guests/virtualmachines":
			body = kubevirtv1.VirtualMachineList{Items: []kubevirtv1.VirtualMachine{vm}}
		case "/apis/kubevirt.io/v1/namespaces/guests/virtualmachineinstances":
			body = kubevirtv1.VirtualMachineInstanceList{Items: []kubevirtv1.VirtualMachineInstance{vmi}}
		default:
			http.NotFound(w, r)
			return
		}
		if r.URL.Query().Get("resourceVersion") != "" {
			t.Errorf("%s listed with resourceVersion %q: a quorum read has none", r.URL.Path, r.URL.Query().Get("resourceVersion"))
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(body)
	}))
	defer srv.Close()
	c, err := host.NewForConfig(&rest.Config{Host: srv.URL}, "guests")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	vms, err := NewClaimReader(c).ListVMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantVM := kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: "vm-1", Namespace: "guests"},
		Spec: kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: kubevirtv1.VirtualMachineInstanceSpec{
			Volumes: []kubevirtv1.Volume{
				{Name: "rootdisk", VolumeSource: kubevirtv1.VolumeSource{DataVolume: &kubevirtv1.DataVolumeSource{Name: "dv-root"}}},
				pvcVolume("pvc-a", "pvc-a", true),
				{Name: "cloudinit"},
			}}}},
		Status: kubevirtv1.VirtualMachineStatus{VolumeRequests: []kubevirtv1.VirtualMachineVolumeRequest{
			{AddVolumeOptions: &kubevirtv1.AddVolumeOptions{Name: "pvc-b",
				VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
					PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: "pvc-b"}, Hotpluggable: true}}}},
			{RemoveVolumeOptions: &kubevirtv1.RemoveVolumeOptions{Name: "pvc-a"}},
		}},
	}
	if len(vms) != 1 || !reflect.DeepEqual(vms[0], wantVM) {
		t.Errorf("VMs:\n got %+v\nwant %+v", vms, wantVM)
	}
	vmis, err := NewClaimReader(c).ListVMIs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantVMI := kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: "vm-1", Namespace: "guests"},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{Volumes: []kubevirtv1.Volume{pvcVolume("pvc-a", "pvc-a", true)}},
		Status: kubevirtv1.VirtualMachineInstanceStatus{VolumeStatus: []kubevirtv1.VolumeStatus{
			{Name: "pvc-a", Phase: kubevirtv1.VolumeReady, HotplugVolume: &kubevirtv1.HotplugVolumeStatus{},
				PersistentVolumeClaimInfo: &kubevirtv1.PersistentVolumeClaimInfo{ClaimName: "pvc-a"}},
			{Name: "pvc-c", Phase: kubevirtv1.HotplugVolumeDetaching, HotplugVolume: &kubevirtv1.HotplugVolumeStatus{}},
			{Name: "rootdisk", Phase: kubevirtv1.VolumeReady},
		}},
	}
	if len(vmis) != 1 || !reflect.DeepEqual(vmis[0], wantVMI) {
		t.Errorf("VMIs:\n got %+v\nwant %+v", vmis, wantVMI)
	}
}
