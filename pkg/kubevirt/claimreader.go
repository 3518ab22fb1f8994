package kubevirt

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// ClaimReader is the hotplug queue's view of the API server (hotplug.Reader).
// Its VM and VMI lists are the quorum reads the queue makes before every
// exclusive attach, of the whole namespace: at 50 VMs with 20 volumes each
// that is about a megabyte of JSON per batch, and decoding it into complete
// KubeVirt objects was half of the controller's CPU. ClaimReader decodes only
// what says which claims an object holds (names, volumes and their claim,
// legacy volume requests, volume status entries and their claim) and leaves
// every other field empty.
type ClaimReader struct{ c *host.Client }

// NewClaimReader returns the hotplug queue's reader over c.
func NewClaimReader(c *host.Client) *ClaimReader { return &ClaimReader{c: c} }

// VMExists reads the VM from the API server, not from a cache.
func (r *ClaimReader) VMExists(ctx context.Context, vm string) (bool, error) {
	return NewReader(r.c).VMExists(ctx, vm)
}

// Claim reads a host PVC and its reservation from the API server.
func (r *ClaimReader) Claim(ctx context.Context, claim string) (hotplug.HostClaim, error) {
	return r.c.Claim(ctx, claim)
}

// Reserve writes a reservation on a host PVC if it has not changed since it
// was read.
func (r *ClaimReader) Reserve(ctx context.Context, from hotplug.HostClaim, res hotplug.Reservation) (hotplug.HostClaim, error) {
	return r.c.Reserve(ctx, from, res)
}

// claimSource is the part of a volume source that names a claim.
type claimSource struct {
	PersistentVolumeClaim *struct {
		ClaimName    string `json:"claimName"`
		Hotpluggable bool   `json:"hotpluggable"`
	} `json:"persistentVolumeClaim"`
	DataVolume *struct {
		Name         string `json:"name"`
		Hotpluggable bool   `json:"hotpluggable"`
	} `json:"dataVolume"`
}

func (s *claimSource) into(v *kubevirtv1.VolumeSource) {
	if p := s.PersistentVolumeClaim; p != nil {
		v.PersistentVolumeClaim = &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: p.ClaimName}, Hotpluggable: p.Hotpluggable}
	}
	if d := s.DataVolume; d != nil {
		v.DataVolume = &kubevirtv1.DataVolumeSource{Name: d.Name, Hotpluggable: d.Hotpluggable}
	}
}

type claimVolume struct {
	Name string `json:"name"`
	claimSource
}

func volumes(in []claimVolume) []kubevirtv1.Volume {
	out := make([]kubevirtv1.Volume, len(in))
	for i := range in {
		out[i].Name = in[i].Name
		in[i].into(&out[i].VolumeSource)
	}
	return out
}

type nameOnly struct {
	Name string `json:"name"`
}

// ListVMs lists the namespace's VMs from the API server with a quorum read
// (no resourceVersion), so the answer includes every write made before it.
// Only the name, the template's volumes and the legacy volume requests are
// filled in.
func (r *ClaimReader) ListVMs(ctx context.Context) ([]kubevirtv1.VirtualMachine, error) {
	var list struct {
		Items []struct {
			Metadata nameOnly `json:"metadata"`
			Spec     struct {
				Template *struct {
					Spec struct {
						Volumes []claimVolume `json:"volumes"`
					} `json:"spec"`
				} `json:"template"`
			} `json:"spec"`
			Status struct {
				VolumeRequests []struct {
					AddVolumeOptions *struct {
						Name         string      `json:"name"`
						VolumeSource claimSource `json:"volumeSource"`
					} `json:"addVolumeOptions"`
					RemoveVolumeOptions *nameOnly `json:"removeVolumeOptions"`
				} `json:"volumeRequests"`
			} `json:"status"`
		} `json:"items"`
	}
	if err := r.list(ctx, "virtualmachines", &list); err != nil {
		return nil, err
	}
	out := make([]kubevirtv1.VirtualMachine, len(list.Items))
	for i, it := range list.Items {
		vm := &out[i]
		vm.Name, vm.Namespace = it.Metadata.Name, r.c.Namespace
		if t := it.Spec.Template; t != nil {
			vm.Spec.Template = &kubevirtv1.VirtualMachineInstanceTemplateSpec{}
			vm.Spec.Template.Spec.Volumes = volumes(t.Spec.Volumes)
		}
		for _, req := range it.Status.VolumeRequests {
			var vr kubevirtv1.VirtualMachineVolumeRequest
			if a := req.AddVolumeOptions; a != nil {
				vr.AddVolumeOptions = &kubevirtv1.AddVolumeOptions{Name: a.Name, VolumeSource: &kubevirtv1.HotplugVolumeSource{}}
				var src kubevirtv1.VolumeSource
				a.VolumeSource.into(&src)
				vr.AddVolumeOptions.VolumeSource.PersistentVolumeClaim = src.PersistentVolumeClaim
				vr.AddVolumeOptions.VolumeSource.DataVolume = src.DataVolume
			}
			if rm := req.RemoveVolumeOptions; rm != nil {
				vr.RemoveVolumeOptions = &kubevirtv1.RemoveVolumeOptions{Name: rm.Name}
			}
			vm.Status.VolumeRequests = append(vm.Status.VolumeRequests, vr)
		}
	}
	return out, nil
}

// ListVMIs lists the namespace's VMIs from the API server with a quorum read.
// Only the name, the volumes and the volume status entries (name, phase and
// claim) are filled in.
func (r *ClaimReader) ListVMIs(ctx context.Context) ([]kubevirtv1.VirtualMachineInstance, error) {
	var list struct {
		Items []struct {
			Metadata nameOnly `json:"metadata"`
			Spec     struct {
				Volumes []claimVolume `json:"volumes"`
			} `json:"spec"`
			Status struct {
				VolumeStatus []struct {
					Name                      string                 `json:"name"`
					Phase                     kubevirtv1.VolumePhase `json:"phase"`
					HotplugVolume             *struct{}              `json:"hotplugVolume"`
					PersistentVolumeClaimInfo *struct {
						ClaimName string `json:"claimName"`
					} `json:"persistentVolumeClaimInfo"`
				} `json:"volumeStatus"`
			} `json:"status"`
		} `json:"items"`
	}
	if err := r.list(ctx, "virtualmachineinstances", &list); err != nil {
		return nil, err
	}
	out := make([]kubevirtv1.VirtualMachineInstance, len(list.Items))
	for i, it := range list.Items {
		vmi := &out[i]
		vmi.Name, vmi.Namespace = it.Metadata.Name, r.c.Namespace
		vmi.Spec.Volumes = volumes(it.Spec.Volumes)
		for _, s := range it.Status.VolumeStatus {
			st := kubevirtv1.VolumeStatus{Name: s.Name, Phase: s.Phase}
			if s.HotplugVolume != nil {
				st.HotplugVolume = &kubevirtv1.HotplugVolumeStatus{}
			}
			if p := s.PersistentVolumeClaimInfo; p != nil {
				st.PersistentVolumeClaimInfo = &kubevirtv1.PersistentVolumeClaimInfo{ClaimName: p.ClaimName}
			}
			vmi.Status.VolumeStatus = append(vmi.Status.VolumeStatus, st)
		}
	}
	return out, nil
}

// list reads one page-less list of a kubevirt.io/v1 resource in the
// namespace as raw JSON and decodes it into out.
func (r *ClaimReader) list(ctx context.Context, resource string, out any) error {
	raw, err := r.c.KubeVirt.KubevirtV1().RESTClient().Get().Namespace(r.c.Namespace).Resource(resource).
		VersionedParams(&metav1.ListOptions{}, metav1.ParameterCodec).DoRaw(ctx)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(raw, out); err != nil {
		return fmt.Errorf("decode %s list: %w", resource, err)
	}
	return nil
}
