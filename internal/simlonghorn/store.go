package simlonghorn

import (
	"context"
	"encoding/json"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
)

// store reads and writes the Longhorn objects of one namespace. It goes
// through JSON rather than the unstructured converter because Volume.Spec.Size
// is encoded as a string (`json:"size,string"`), as longhorn-manager does.
type store struct {
	dyn dynamic.Interface
	ns  string
}

func (s *store) res(gvr schema.GroupVersionResource) dynamic.ResourceInterface {
	return s.dyn.Resource(gvr).Namespace(s.ns)
}

func toU(obj any, kind string) (*unstructured.Unstructured, error) {
	b, err := json.Marshal(obj)
	if err != nil {
		return nil, err
	}
	m := map[string]any{}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion(Group + "/" + Version)
	u.SetKind(kind)
	return u, nil
}

func fromU[T any](u *unstructured.Unstructured) (*T, error) {
	b, err := u.MarshalJSON()
	if err != nil {
		return nil, err
	}
	out := new(T)
	return out, json.Unmarshal(b, out)
}

func (s *store) getVolume(ctx context.Context, name string) (*Volume, error) {
	u, err := s.res(volumeGVR).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return fromU[Volume](u)
}

func (s *store) listVolumes(ctx context.Context) ([]*Volume, error) {
	l, err := s.res(volumeGVR).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	out := make([]*Volume, 0, len(l.Items))
	for i := range l.Items {
		v, err := fromU[Volume](&l.Items[i])
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

func (s *store) createVolume(ctx context.Context, v *Volume) (*Volume, error) {
	u, err := toU(v, "Volume")
	if err != nil {
		return nil, err
	}
	if u, err = s.res(volumeGVR).Create(ctx, u, metav1.CreateOptions{}); err != nil {
		return nil, err
	}
	return fromU[Volume](u)
}

// updateVolume writes v's status, then its spec, each only when changed
// from old; it returns the stored object. Status first: one pass plays the
// volume controller (status) and then the VolumeAttachment controller
// (spec, decided on that status), and longhorn-manager's VolumeAttachment
// controller only ever decides on a stored status (v1.10.1
// controller/volume_attachment_controller.go:293,427-477). Spec first would
// store, between the two writes, a confirmed migration (spec.nodeID on the
// new node) whose status shows no engine there yet.
func (s *store) updateVolume(ctx context.Context, old, v *Volume) (*Volume, error) {
	res := s.res(volumeGVR)
	if !jsonEqual(old.Status, v.Status) {
		u, err := toU(v, "Volume")
		if err != nil {
			return nil, err
		}
		if u, err = res.UpdateStatus(ctx, u, metav1.UpdateOptions{}); err != nil {
			return nil, err
		}
		v.ResourceVersion = u.GetResourceVersion()
	}
	if !jsonEqual(old.Spec, v.Spec) {
		u, err := toU(v, "Volume")
		if err != nil {
			return nil, err
		}
		if u, err = res.Update(ctx, u, metav1.UpdateOptions{}); err != nil {
			return nil, err
		}
		v.ResourceVersion = u.GetResourceVersion()
	}
	return v, nil
}

func (s *store) getVA(ctx context.Context, name string) (*VolumeAttachment, error) {
	u, err := s.res(vaGVR).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return fromU[VolumeAttachment](u)
}

func (s *store) listVAs(ctx context.Context) ([]*VolumeAttachment, error) {
	l, err := s.res(vaGVR).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	out := make([]*VolumeAttachment, 0, len(l.Items))
	for i := range l.Items {
		va, err := fromU[VolumeAttachment](&l.Items[i])
		if err != nil {
			return nil, err
		}
		out = append(out, va)
	}
	return out, nil
}

func (s *store) createVA(ctx context.Context, va *VolumeAttachment) error {
	u, err := toU(va, "VolumeAttachment")
	if err != nil {
		return err
	}
	_, err = s.res(vaGVR).Create(ctx, u, metav1.CreateOptions{})
	return err
}

// updateVA is updateVolume for a VolumeAttachment.
func (s *store) updateVA(ctx context.Context, old, va *VolumeAttachment) error {
	res := s.res(vaGVR)
	if !jsonEqual(old.Spec, va.Spec) {
		u, err := toU(va, "VolumeAttachment")
		if err != nil {
			return err
		}
		if u, err = res.Update(ctx, u, metav1.UpdateOptions{}); err != nil {
			return err
		}
		va.ResourceVersion = u.GetResourceVersion()
	}
	if !jsonEqual(old.Status, va.Status) {
		u, err := toU(va, "VolumeAttachment")
		if err != nil {
			return err
		}
		if _, err = res.UpdateStatus(ctx, u, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

func jsonEqual(a, b any) bool {
	ja, errA := json.Marshal(a)
	jb, errB := json.Marshal(b)
	return errA == nil && errB == nil && string(ja) == string(jb)
}

// clone deep-copies through JSON.
func clone[T any](v *T) *T {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // the types above always marshal
	}
	out := new(T)
	if err := json.Unmarshal(b, out); err != nil {
		panic(err)
	}
	return out
}
